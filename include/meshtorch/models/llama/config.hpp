#pragma once
// The Llama family's hyper-parameters as a structural type: usable at run time (parsed from an
// HF config.json) and as a template argument (constexpr presets), so plans can be checked at
// compile time against a known model. No LibTorch here.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "meshtorch/error.hpp"

namespace meshtorch::llama {

enum class RopeScalingKind { none, llama3 };

// HF's rope_scaling block; only the llama3 type (Llama 3.1+) is used by the family.
struct RopeScaling {
  RopeScalingKind kind = RopeScalingKind::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;

  friend constexpr bool operator==(const RopeScaling&, const RopeScaling&) = default;
};

// Field names follow HF's LlamaConfig so that messages and config.json agree.
struct Config {
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;  // 0 means hidden_size / num_attention_heads
  std::int64_t vocab_size = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling{};
  std::int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  std::int64_t bos_token_id = 1;
  std::int64_t eos_token_id = 2;

  constexpr std::int64_t resolved_head_dim() const {
    return head_dim != 0 ? head_dim : (num_attention_heads > 0 ? hidden_size / num_attention_heads : 0);
  }
  constexpr std::int64_t q_size() const { return num_attention_heads * resolved_head_dim(); }
  constexpr std::int64_t kv_size() const { return num_key_value_heads * resolved_head_dim(); }

  // Parameter count without materialising anything (embedding, layers, final norm, head).
  constexpr std::int64_t num_parameters() const {
    const std::int64_t attention = hidden_size * (2 * q_size() + 2 * kv_size());
    const std::int64_t mlp = 3 * hidden_size * intermediate_size;
    const std::int64_t norms = 2 * hidden_size;
    const std::int64_t head = tie_word_embeddings ? 0 : vocab_size * hidden_size;
    return vocab_size * hidden_size + num_hidden_layers * (attention + mlp + norms) + hidden_size + head;
  }

  friend constexpr bool operator==(const Config&, const Config&) = default;
};

// The first field that makes a config unusable, or nothing. constexpr so presets are checked
// where they are defined.
constexpr std::optional<std::string_view> first_invalid_field(const Config& c) {
  if (c.hidden_size <= 0) return "hidden_size must be positive";
  if (c.intermediate_size <= 0) return "intermediate_size must be positive";
  if (c.num_hidden_layers <= 0) return "num_hidden_layers must be positive";
  if (c.num_attention_heads <= 0) return "num_attention_heads must be positive";
  if (c.num_key_value_heads <= 0) return "num_key_value_heads must be positive";
  if (c.vocab_size <= 0) return "vocab_size must be positive";
  if (c.head_dim < 0) return "head_dim must not be negative";
  if (c.head_dim == 0 && c.hidden_size % c.num_attention_heads != 0)
    return "hidden_size must be divisible by num_attention_heads (or give head_dim)";
  if (c.resolved_head_dim() % 2 != 0) return "head_dim must be even for rotary embeddings";
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return "num_attention_heads must be a multiple of num_key_value_heads";
  if (!(c.rms_norm_eps > 0)) return "rms_norm_eps must be positive";
  if (!(c.rope_theta > 0)) return "rope_theta must be positive";
  if (c.max_position_embeddings <= 0) return "max_position_embeddings must be positive";
  if (!(c.initializer_range > 0)) return "initializer_range must be positive";
  if (c.rope_scaling.kind == RopeScalingKind::llama3) {
    if (!(c.rope_scaling.factor >= 1)) return "rope_scaling.factor must be >= 1";
    if (!(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor))
      return "rope_scaling.high_freq_factor must exceed rope_scaling.low_freq_factor";
    if (c.rope_scaling.original_max_position_embeddings <= 0)
      return "rope_scaling.original_max_position_embeddings must be positive";
  }
  return std::nullopt;
}

inline void validate(const Config& c, std::string_view source = "config") {
  if (auto problem = first_invalid_field(c))
    throw ConfigError(std::string(source) + ": " + std::string(*problem));
}

namespace presets {

// The embedded default: byte-level vocabulary (256 bytes + bos/eos + padding to a multiple
// of 8, so TP up to 8 divides it), small enough to train on two CPU cores in minutes.
inline constexpr Config llama_tiny{.hidden_size = 128, .intermediate_size = 384, .num_hidden_layers = 4,
                                   .num_attention_heads = 8, .num_key_value_heads = 4, .vocab_size = 264,
                                   .rms_norm_eps = 1e-5, .rope_theta = 10000.0, .max_position_embeddings = 2048,
                                   .tie_word_embeddings = false, .initializer_range = 0.02,
                                   .bos_token_id = 256, .eos_token_id = 257};

inline constexpr RopeScaling llama31_rope{.kind = RopeScalingKind::llama3, .factor = 8.0, .low_freq_factor = 1.0,
                                          .high_freq_factor = 4.0, .original_max_position_embeddings = 8192};

// Published dimensions of Meta's checkpoints (their config.json files).
inline constexpr Config llama_3_2_1b{.hidden_size = 2048, .intermediate_size = 8192, .num_hidden_layers = 16,
                                     .num_attention_heads = 32, .num_key_value_heads = 8, .head_dim = 64,
                                     .vocab_size = 128256, .rms_norm_eps = 1e-5, .rope_theta = 500000.0,
                                     .rope_scaling = {.kind = RopeScalingKind::llama3, .factor = 32.0,
                                                      .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                                                      .original_max_position_embeddings = 8192},
                                     .max_position_embeddings = 131072, .tie_word_embeddings = true,
                                     .initializer_range = 0.02, .bos_token_id = 128000, .eos_token_id = 128001};

inline constexpr Config llama_3_1_8b{.hidden_size = 4096, .intermediate_size = 14336, .num_hidden_layers = 32,
                                     .num_attention_heads = 32, .num_key_value_heads = 8, .head_dim = 128,
                                     .vocab_size = 128256, .rms_norm_eps = 1e-5, .rope_theta = 500000.0,
                                     .rope_scaling = llama31_rope, .max_position_embeddings = 131072,
                                     .tie_word_embeddings = false, .initializer_range = 0.02,
                                     .bos_token_id = 128000, .eos_token_id = 128001};

inline constexpr Config llama_3_1_70b{.hidden_size = 8192, .intermediate_size = 28672, .num_hidden_layers = 80,
                                      .num_attention_heads = 64, .num_key_value_heads = 8, .head_dim = 128,
                                      .vocab_size = 128256, .rms_norm_eps = 1e-5, .rope_theta = 500000.0,
                                      .rope_scaling = llama31_rope, .max_position_embeddings = 131072,
                                      .tie_word_embeddings = false, .initializer_range = 0.02,
                                      .bos_token_id = 128000, .eos_token_id = 128001};

inline constexpr Config llama_3_1_405b{.hidden_size = 16384, .intermediate_size = 53248,
                                       .num_hidden_layers = 126, .num_attention_heads = 128,
                                       .num_key_value_heads = 8, .head_dim = 128, .vocab_size = 128256,
                                       .rms_norm_eps = 1e-5, .rope_theta = 500000.0, .rope_scaling = llama31_rope,
                                       .max_position_embeddings = 131072, .tie_word_embeddings = false,
                                       .initializer_range = 0.02, .bos_token_id = 128000,
                                       .eos_token_id = 128001};

static_assert(!first_invalid_field(llama_tiny) && !first_invalid_field(llama_3_2_1b) &&
              !first_invalid_field(llama_3_1_8b) && !first_invalid_field(llama_3_1_70b) &&
              !first_invalid_field(llama_3_1_405b));

struct Named {
  std::string_view name;
  Config config;
};

inline constexpr std::array<Named, 5> all{{{"llama-tiny", llama_tiny},
                                           {"llama-3.2-1b", llama_3_2_1b},
                                           {"llama-3.1-8b", llama_3_1_8b},
                                           {"llama-3.1-70b", llama_3_1_70b},
                                           {"llama-3.1-405b", llama_3_1_405b}}};

constexpr std::optional<Config> find(std::string_view name) {
  for (const auto& preset : all)
    if (preset.name == name) return preset.config;
  return std::nullopt;
}

}  // namespace presets
}  // namespace meshtorch::llama
