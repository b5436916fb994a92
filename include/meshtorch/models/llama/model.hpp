#pragma once
// Llama for causal LM, with HF's module tree so that named_parameters() are HF's names
// ("model.layers.0.self_attn.q_proj.weight", ...). The model knows nothing of parallelism:
// attention derives its local head count from the projection's width, so a tensor-parallel
// plan can shard q/k/v/o from outside without touching this file.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/kernels/causal_attention.hpp>
#include <meshtorch/kernels/cross_entropy.hpp>
#include <meshtorch/kernels/rotary.hpp>
#include <meshtorch/kernels/swiglu.hpp>
#include <meshtorch/models/chunked_loss.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/llama/kv_cache.hpp>
#include <meshtorch/models/llama/layers.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

class AttentionImpl : public torch::nn::Module {
 public:
  MESHTORCH_DECL AttentionImpl(const Config& c, const torch::TensorOptions& options);

  // With `cached`, a decoding step: its keys and values go into the cache and its queries attend
  // the cached positions `cached->mask` allows, instead of causal attention over x alone.
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                       const CachedAttention* cached = nullptr);

  // Causal attention of q [B, H, S, D] over k and v [B, Hkv, S, D] (positions already rotated),
  // giving [B, H, S, D]: what a layout that splits the sequence replaces (context parallel's
  // attention over every rank's keys). Empty: LibTorch's scaled-dot-product attention.
  using CausalAttention =
      std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v)>;

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // Qwen3's RMSNorm of each head's q and k (over head_dim, one weight for every head), before
  // the rotation; null for the other families.
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  ForwardHooks hooks;
  CausalAttention causal_attention;  // set from outside
  bool fused_kernels = true;         // kernels/rotary.hpp's fused CPU kernel, or the composite ops

 private:
  MESHTORCH_DECL torch::Tensor attend(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                      const CachedAttention* cached);

  std::int64_t head_dim_;
  std::int64_t sliding_window_;  // 0: none
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  MESHTORCH_DECL MlpImpl(const Config& c, const torch::TensorOptions& options);
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& x);

  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  ForwardHooks hooks;
  bool fused_kernels = true;  // kernels/swiglu.hpp's fused CPU kernel, or the composite ops
};
TORCH_MODULE(Mlp);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  MESHTORCH_DECL DecoderLayerImpl(const Config& c, const torch::TensorOptions& options);
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                       const CachedAttention* cached = nullptr);

  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  ForwardHooks hooks;
};
TORCH_MODULE(DecoderLayer);

class LlamaModelImpl : public torch::nn::Module {
 public:
  MESHTORCH_DECL LlamaModelImpl(const Config& c, const torch::TensorOptions& options);

  // Hidden states after the final norm. position_ids are explicit when the sequence is
  // sharded (sequence parallel); by default they are 0..S-1 for every row.
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& input_ids,
                                       const std::optional<torch::Tensor>& position_ids = {});

  // Decoder layers [first, end) over hidden states [B, S, hidden] at `positions` ([1 or B, S]),
  // without the final norm: what forward() runs between the embedding and the norm, and what a
  // pipeline stage runs of it.
  MESHTORCH_DECL torch::Tensor run_layers(torch::Tensor hidden, const torch::Tensor& positions, std::int64_t first,
                                          std::int64_t end);

  // A decoding step (models/llama/generate.hpp): hidden states after the final norm of
  // `input_ids` [B, S] at `positions` [B, S], its keys and values written into `cache` after its
  // filled part, each query attending the cached positions `mask` [B, 1, S, filled + S] allows.
  // The caller advances the cache.
  MESHTORCH_DECL torch::Tensor forward_cached(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                              const KvCache& cache, const torch::Tensor& mask);

  // Positions 0..S-1 for every row of a [B, S] batch.
  static torch::Tensor default_positions(std::int64_t seq_length, const torch::Device& device) {
    return torch::arange(seq_length, torch::TensorOptions().dtype(torch::kLong).device(device)).unsqueeze(0);
  }

  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<DecoderLayer> decoder_layers;  // typed view of `layers`
  RMSNorm norm{nullptr};
  Rotary rotary;
};
TORCH_MODULE(LlamaModel);

// Host bytes one decoder layer's modules take even on the meta device (module objects, names,
// parameter handles): 16 kB measured at llama-tiny, rounded up.
inline constexpr std::uint64_t layer_module_bytes = 16 * 1024;

// A ConfigError, before anything is built, when a model of `c` on `options`' device would not fit
// in the memory this process may take: its weights on the CPU, and on any device its layers'
// modules. A config.json of 10,000,000 layers (2.1e12 parameters, under max_parameters) was built
// until the kernel killed the process, before its weights' four layers could be compared.
MESHTORCH_DECL void check_fits_host_memory(const Config& c, const torch::TensorOptions& options);

class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  // options.device(torch::kMeta) builds the shapes without memory; see materialize().
  MESHTORCH_DECL explicit LlamaForCausalLMImpl(const Config& c, const torch::TensorOptions& options = {});

  torch::Tensor output_weight() const {
    return lm_head ? lm_head->weight_in_use() : model->embed_tokens->weight_in_use();
  }

  // Logits [B, S, vocab] in the parameters' dtype. `hooks` run around the whole forward (input:
  // the token ids); `head_hooks` around the output projection (input: the final hidden states),
  // which is lm_head or, with tied embeddings, the embedding matrix.
  MESHTORCH_DECL torch::Tensor forward(const torch::Tensor& input_ids,
                                       const std::optional<torch::Tensor>& position_ids = {});

  // Next-token targets [B, S], as HF's ForCausalLMLoss: labels shifted left by one, the last
  // position ignored (-100), so no copy of the logits is made.
  MESHTORCH_DECL static torch::Tensor next_token_targets(const torch::Tensor& labels);

  // The sum of the cross entropies of rows of logits against their targets (-100 ignored), in fp32:
  // kernels/cross_entropy.hpp's fused kernel, or the composite ops.
  MESHTORCH_DECL static torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                                        bool fused = false);

  // Mean next-token cross entropy of logits [B, S, vocab].
  MESHTORCH_DECL static torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels);

  // Mean next-token cross entropy of the batch. The logits are computed `loss_chunk` positions at
  // a time when that is fewer than the batch's (models/chunked_loss.hpp), so the whole batch's
  // logits never exist; the result equals the plain loss up to summation order. Under `hooks`
  // as forward() is, so wrappers see the same calls.
  MESHTORCH_DECL torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels);

  // The loss of some of a batch's positions (context parallel's chunks of it): the token losses
  // of `input_ids` [B, s] at `positions` [1 or B, s] against their next-token `targets` [B * s]
  // (-100 ignored), summed and divided by `divisor`. loss() is this over every position, divided
  // by the count of targets. Under `hooks` as forward() is.
  MESHTORCH_DECL torch::Tensor loss_at(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                       const torch::Tensor& targets, const torch::Tensor& divisor);

  // The sum (fp32) of the token losses of final hidden states [B, S, hidden] (after the norm)
  // against next-token `targets` [B * S] (-100 ignored): loss()'s head, chunked as it is, for a
  // caller that divides by its own count (a pipeline's last stage, by the step's tokens).
  MESHTORCH_DECL torch::Tensor head_loss_sum(const torch::Tensor& hidden, const torch::Tensor& targets);

  // The fused kernels of kernels/ (the default), or LibTorch's composite ops for the same maths
  // (--fused off): RMSNorm with the residual add before it, SwiGLU, rotary embeddings, and the
  // products of a decoding step's few rows.
  MESHTORCH_DECL void use_fused_kernels(bool fused);
  bool fused_kernels = true;  // what use_fused_kernels set last

  const Config config;
  LlamaModel model{nullptr};
  Linear lm_head{nullptr};
  ForwardHooks hooks, head_hooks;
  // Set from outside: the loss over rows of logits (tensor parallel's vocab-parallel one under
  // loss parallel; empty: cross_entropy_sum), and the positions per chunk of loss()
  // (loss_chunk_positions: -1 automatic, 0 all at once).
  TokenLossSum token_loss;
  std::int64_t loss_chunk = -1;
};
TORCH_MODULE(LlamaForCausalLM);

// HF's _init_weights for one tensor of a leaf: `tensor` (the leaf's own, or a full copy of it
// that a wrapper holding shards draws) ~ N(0, initializer_range) for linears' and embeddings'
// weights, ones for norms, zeros for biases. Uses the default generator, so a seed fixes the result.
MESHTORCH_DECL void init_weight(const WeightModule& leaf, LeafSlot slot, torch::Tensor& tensor, const Config& config);

// init_weight on every tensor, in leaf_tensors() order.
MESHTORCH_DECL void init_weights(LlamaForCausalLM& lm);

// Gives every parameter still on the meta device real storage with `options`, then
// initialises the model (the guide's to_empty + reset_parameters).
MESHTORCH_DECL void materialize(LlamaForCausalLM& lm, const torch::TensorOptions& options);

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/io/host_memory.hpp>

namespace meshtorch::llama {

MESHTORCH_DECL AttentionImpl::AttentionImpl(const Config& c, const torch::TensorOptions& options)
    : head_dim_(c.resolved_head_dim()), sliding_window_(c.sliding_window) {
  q_proj = register_module("q_proj", Linear(c.hidden_size, c.q_size(), options, c.qkv_bias()));
  k_proj = register_module("k_proj", Linear(c.hidden_size, c.kv_size(), options, c.qkv_bias()));
  v_proj = register_module("v_proj", Linear(c.hidden_size, c.kv_size(), options, c.qkv_bias()));
  o_proj = register_module("o_proj", Linear(c.q_size(), c.hidden_size, options));
  if (c.qk_norm()) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps, options));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps, options));
  }
}

MESHTORCH_DECL torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                    const torch::Tensor& sin, const CachedAttention* cached) {
  return hooks.around(x, [&](const torch::Tensor& in) { return attend(in, cos, sin, cached); });
}

MESHTORCH_DECL torch::Tensor AttentionImpl::attend(const torch::Tensor& x, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, const CachedAttention* cached) {
  const auto batch = x.size(0), seq = x.size(1);
  if (sliding_window_ > 0 && seq > sliding_window_)
    throw ConfigError(
        fmt::format("a sequence of {} positions is longer than the model's sliding_window ({}); "
                    "sliding-window attention is not implemented: use sequences of at most {} positions",
                    seq, sliding_window_, sliding_window_));
  // Rotated in the projections' [B, S, heads, D] layout; attention reads [B, heads, S, D] views.
  const auto heads_of = [&](const torch::Tensor& projected) { return projected.view({batch, seq, -1, head_dim_}); };
  auto q_heads = heads_of(q_proj(x)), k_heads = heads_of(k_proj(x));
  if (q_norm) {
    q_heads = q_norm(q_heads);
    k_heads = k_norm(k_heads);
  }
  auto [rotated_q, rotated_k] = fused_kernels ? kernels::rotary(q_heads, k_heads, cos, sin)
                                              : kernels::composite::rotary(q_heads, k_heads, cos, sin);
  auto q = rotated_q.transpose(1, 2);
  auto k = rotated_k.transpose(1, 2);
  auto v = heads_of(v_proj(x)).transpose(1, 2);
  if (!cached) {
    const auto out = causal_attention ? causal_attention(q, k, v)
                     : fused_kernels  ? kernels::causal_attention(q, k, v)
                                      : kernels::composite::causal_attention(q, k, v);
    return o_proj(out.transpose(1, 2).reshape({batch, seq, -1}));
  }
  cached->keys.narrow(2, cached->start, seq).copy_(k);
  cached->values.narrow(2, cached->start, seq).copy_(v);
  k = cached->keys.narrow(2, 0, cached->start + seq);
  v = cached->values.narrow(2, 0, cached->start + seq);
  // Without a mask (no padding): causal from the cache's start, or one query over every key.
  const bool masked = cached->mask.defined();
  if (!masked && cached->start > 0 && seq > 1)
    throw ConfigError("a decoding step of several positions after the first needs a mask (CachedAttention::mask)");
  const auto mask = masked ? std::optional<torch::Tensor>(cached->mask) : std::nullopt;
  const auto out = kernels::composite::attention(q, k, v, mask, /*is_causal=*/!masked && seq > 1);
  return o_proj(out.transpose(1, 2).reshape({batch, seq, -1}));
}

MESHTORCH_DECL MlpImpl::MlpImpl(const Config& c, const torch::TensorOptions& options) {
  gate_proj = register_module("gate_proj", Linear(c.hidden_size, c.intermediate_size, options));
  up_proj = register_module("up_proj", Linear(c.hidden_size, c.intermediate_size, options));
  down_proj = register_module("down_proj", Linear(c.intermediate_size, c.hidden_size, options));
}

MESHTORCH_DECL torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return hooks.around(x, [&](const torch::Tensor& in) {
    return down_proj(fused_kernels ? kernels::swiglu(gate_proj(in), up_proj(in))
                                   : kernels::composite::swiglu(gate_proj(in), up_proj(in)));
  });
}

MESHTORCH_DECL DecoderLayerImpl::DecoderLayerImpl(const Config& c, const torch::TensorOptions& options) {
  self_attn = register_module("self_attn", Attention(c, options));
  mlp = register_module("mlp", Mlp(c, options));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, options));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, options));
}

MESHTORCH_DECL torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                       const torch::Tensor& sin, const CachedAttention* cached) {
  // By value: a checkpointed layer runs this again in backward (a decoding step, with `cached`,
  // has no backward).
  return hooks.around(x, [this, cos, sin, cached](const torch::Tensor& in) {
    auto [h, normed] =
        post_attention_layernorm->add_and_forward(in, self_attn->forward(input_layernorm(in), cos, sin, cached));
    return h + mlp(normed);
  });
}

MESHTORCH_DECL LlamaModelImpl::LlamaModelImpl(const Config& c, const torch::TensorOptions& options) : rotary(c) {
  embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size, options));
  layers = register_module("layers", torch::nn::ModuleList());
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    decoder_layers.push_back(DecoderLayer(c, options));
    layers->push_back(decoder_layers.back());
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps, options));
}

MESHTORCH_DECL torch::Tensor LlamaModelImpl::forward(const torch::Tensor& input_ids,
                                                     const std::optional<torch::Tensor>& position_ids) {
  const auto positions = position_ids ? *position_ids : default_positions(input_ids.size(1), input_ids.device());
  return norm(run_layers(embed_tokens(input_ids), positions, 0, static_cast<std::int64_t>(decoder_layers.size())));
}

MESHTORCH_DECL torch::Tensor LlamaModelImpl::run_layers(torch::Tensor hidden, const torch::Tensor& positions,
                                                        std::int64_t first, std::int64_t end) {
  if (first >= end) return hidden;
  auto [cos, sin] = rotary.tables(positions, hidden.scalar_type());
  for (std::int64_t i = first; i < end; ++i) hidden = decoder_layers.at(static_cast<std::size_t>(i))(hidden, cos, sin);
  return hidden;
}

MESHTORCH_DECL torch::Tensor LlamaModelImpl::forward_cached(const torch::Tensor& input_ids,
                                                            const torch::Tensor& positions, const KvCache& cache,
                                                            const torch::Tensor& mask) {
  auto hidden = embed_tokens(input_ids);
  auto [cos, sin] = rotary.tables(positions, hidden.scalar_type());
  for (std::size_t i = 0; i < decoder_layers.size(); ++i) {
    const auto step = cache.step(i, mask);
    hidden = decoder_layers[i]->forward(hidden, cos, sin, &step);
  }
  return norm(hidden);
}

MESHTORCH_DECL void check_fits_host_memory(const Config& c, const torch::TensorOptions& options) {
  const auto memory = io::available_host_memory();
  if (!memory) return;
  const auto device = options.device();
  const auto parameters = c.parameter_counts();  // validate() has checked that it exists
  const double weights = device.is_cpu() ? static_cast<double>(parameters->total) *
                                               static_cast<double>(c10::elementSize(options.dtype().toScalarType()))
                                         : 0.0;
  const double modules = static_cast<double>(c.num_hidden_layers) * static_cast<double>(layer_module_bytes);
  if (weights + modules <= static_cast<double>(memory->available_bytes)) return;
  throw ConfigError(fmt::format(
      "a Llama of {:.2g} parameters (num_hidden_layers {}, hidden_size {}, intermediate_size {}, vocab_size {}) "
      "needs {} of host memory to build on {}{}, and this process may take {} ({}); check the config's sizes{}",
      static_cast<double>(parameters->total), c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size,
      detail::human_bytes(weights + modules), device.str(),
      device.is_cpu() ? fmt::format(" ({} of {} weights)", detail::human_bytes(weights),
                                    c10::toString(options.dtype().toScalarType()))
                      : fmt::format(" (the modules of its layers, {} each)", detail::human_bytes(layer_module_bytes)),
      detail::human_bytes(static_cast<double>(memory->available_bytes)), memory->source,
      device.is_cpu() ? ", or build it on the meta device and shard it (parallelize, FSDP)" : ""));
}

MESHTORCH_DECL LlamaForCausalLMImpl::LlamaForCausalLMImpl(const Config& c, const torch::TensorOptions& options)
    : config(c) {
  validate(c);
  check_fits_host_memory(c, options);
  model = register_module("model", LlamaModel(c, options));
  if (!c.tie_word_embeddings) lm_head = register_module("lm_head", Linear(c.hidden_size, c.vocab_size, options));
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& input_ids,
                                                           const std::optional<torch::Tensor>& position_ids) {
  return hooks.around(input_ids, [&](const torch::Tensor& ids) {
    return head_hooks.around(model(ids, position_ids),
                             [&](const torch::Tensor& h) { return at::linear(h, output_weight()); });
  });
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::next_token_targets(const torch::Tensor& labels) {
  return torch::cat({labels.narrow(1, 1, labels.size(1) - 1), torch::full({labels.size(0), 1}, -100, labels.options())},
                    1);
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::cross_entropy_sum(const torch::Tensor& logits,
                                                                     const torch::Tensor& targets, bool fused) {
  const auto fp32 = logits.to(torch::kFloat);
  return fused ? kernels::cross_entropy_sum(fp32, targets) : kernels::composite::cross_entropy_sum(fp32, targets);
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::causal_lm_loss(const torch::Tensor& logits,
                                                                  const torch::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}),
                                              next_token_targets(labels).view({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
  const auto targets = next_token_targets(labels).reshape({-1});
  return loss_at(input_ids, LlamaModelImpl::default_positions(input_ids.size(1), input_ids.device()), targets,
                 targets.ne(-100).sum().to(torch::kFloat));
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::loss_at(const torch::Tensor& input_ids,
                                                           const torch::Tensor& positions, const torch::Tensor& targets,
                                                           const torch::Tensor& divisor) {
  return hooks.around(
      input_ids, [&](const torch::Tensor& ids) { return head_loss_sum(model(ids, positions), targets) / divisor; });
}

MESHTORCH_DECL torch::Tensor LlamaForCausalLMImpl::head_loss_sum(const torch::Tensor& hidden,
                                                                 const torch::Tensor& targets) {
  const auto rows = head_hooks.before(hidden).reshape({-1, hidden.size(-1)});
  const auto weight = output_weight();
  const TokenLossSum token_loss =
      this->token_loss
          ? this->token_loss
          : TokenLossSum([fused = fused_kernels](const torch::Tensor& logits, const torch::Tensor& targets) {
              return cross_entropy_sum(logits, targets, fused);
            });
  const auto after = [this, hidden](const torch::Tensor& logits) { return head_hooks.after(hidden, logits); };
  const auto chunk = loss_chunk_positions(loss_chunk, rows.size(0), weight.size(0));
  const auto sum = chunk >= rows.size(0) ? token_loss(after(at::linear(rows, weight)), targets)
                                         : chunked_linear_loss(rows, weight, targets, chunk, after, token_loss);
  return sum.to(torch::kFloat);
}

MESHTORCH_DECL void LlamaForCausalLMImpl::use_fused_kernels(bool fused) {
  fused_kernels = fused;
  for (auto& module : modules()) {
    if (auto* norm = dynamic_cast<RMSNormImpl*>(module.get())) norm->fused_kernels = fused;
    if (auto* linear = dynamic_cast<LinearImpl*>(module.get())) linear->fused_kernels = fused;
    if (auto* attention = dynamic_cast<AttentionImpl*>(module.get())) attention->fused_kernels = fused;
    if (auto* mlp = dynamic_cast<MlpImpl*>(module.get())) mlp->fused_kernels = fused;
  }
}

MESHTORCH_DECL void init_weight(const WeightModule& leaf, LeafSlot slot, torch::Tensor& tensor, const Config& config) {
  torch::NoGradGuard no_grad;
  if (slot == LeafSlot::bias)
    tensor.zero_();  // as transformers' _init_weights: no random numbers drawn
  else if (dynamic_cast<const RMSNormImpl*>(&leaf))
    tensor.fill_(1.0);
  else
    tensor.normal_(0.0, config.initializer_range);
}

MESHTORCH_DECL void init_weights(LlamaForCausalLM& lm) {
  for (const auto& t : leaf_tensors(*lm)) init_weight(*t.leaf, t.slot, t.tensor(), lm->config);
}

MESHTORCH_DECL void materialize(LlamaForCausalLM& lm, const torch::TensorOptions& options) {
  for (auto& [name, leaf] : weight_modules(*lm)) {
    if (leaf->weight.is_meta()) leaf->materialize(options);
  }
  init_weights(lm);
}

}  // namespace meshtorch::llama
#endif  // MESHTORCH_DEFINES(core)
