#pragma once
// The Llama family's hyper-parameters as a structural type: usable at run time (parsed from an
// HF config.json) and as a template argument (constexpr presets), so plans can be checked at
// compile time against a known model. No LibTorch here.
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

enum class RopeScalingKind { none, llama3 };

// The Llama-style families a config.json may name (its model_type). One model serves them all;
// what sets a family apart is a trait here, read by the model, the plans and the writers.
enum class Family { llama, mistral, qwen2, qwen3 };

struct FamilyTraits {
  std::string_view model_type;    // config.json's model_type
  std::string_view architecture;  // config.json's architectures[0], what transformers builds
  bool qk_norm;                   // an RMSNorm over each head's q and k, before the rotation (Qwen3)
  bool qkv_bias;                  // biases on the q, k and v projections (Qwen2)
  bool qwen_window;               // use_sliding_window / max_window_layers / layer_types (Qwen2, Qwen3)
};

constexpr FamilyTraits traits(Family family) {
  switch (family) {
    case Family::mistral:
      return {"mistral", "MistralForCausalLM", false, false, false};
    case Family::qwen2:
      return {"qwen2", "Qwen2ForCausalLM", false, true, true};
    case Family::qwen3:
      return {"qwen3", "Qwen3ForCausalLM", true, false, true};
    case Family::llama:
      break;
  }
  return {"llama", "LlamaForCausalLM", false, false, false};
}

inline constexpr std::array<Family, 4> all_families{Family::llama, Family::mistral, Family::qwen2, Family::qwen3};

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
  Family family = Family::llama;
  // The attention span of a sliding-window model (Mistral's sliding_window); 0: every earlier
  // position. Sliding-window attention is not implemented: a sequence longer than the window is
  // refused, and one within it is computed exactly.
  std::int64_t sliding_window = 0;
  std::int64_t sliding_window_from_layer = 0;  // the first layer the window applies to (Qwen3's max_window_layers)

  constexpr bool qk_norm() const { return traits(family).qk_norm; }
  constexpr bool qkv_bias() const { return traits(family).qkv_bias; }

  constexpr std::int64_t resolved_head_dim() const {
    return head_dim != 0 ? head_dim : (num_attention_heads > 0 ? hidden_size / num_attention_heads : 0);
  }
  constexpr std::int64_t q_size() const { return num_attention_heads * resolved_head_dim(); }
  constexpr std::int64_t kv_size() const { return num_key_value_heads * resolved_head_dim(); }

  struct ParameterCounts {
    std::int64_t embedding = 0;    // embed_tokens
    std::int64_t attention = 0;    // q, k, v and o of one decoder layer, with q/k/v's biases (Qwen2)
    std::int64_t mlp = 0;          // gate, up and down of one decoder layer
    std::int64_t layer_norms = 0;  // the two norms of one decoder layer, and its q/k norms (Qwen3)
    std::int64_t final_norm = 0;
    std::int64_t head = 0;  // lm_head; 0 when tied to the embedding
    std::int64_t total = 0;
  };

  // Parameter counts without materialising anything, computed overflow-safe: nothing when a
  // product leaves int64 (a config that validate() refuses).
  constexpr std::optional<ParameterCounts> parameter_counts() const {
    bool overflow = false;
    const auto mul = [&](std::int64_t a, std::int64_t b) {
      std::int64_t product = 0;
      overflow |= __builtin_mul_overflow(a, b, &product);
      return product;
    };
    const auto add = [&](std::int64_t a, std::int64_t b) {
      std::int64_t sum = 0;
      overflow |= __builtin_add_overflow(a, b, &sum);
      return sum;
    };
    const std::int64_t q = mul(num_attention_heads, resolved_head_dim());
    const std::int64_t kv = mul(num_key_value_heads, resolved_head_dim());
    ParameterCounts p;
    p.embedding = mul(vocab_size, hidden_size);
    p.attention = add(mul(hidden_size, add(mul(2, q), mul(2, kv))), qkv_bias() ? add(q, mul(2, kv)) : 0);
    p.mlp = mul(3, mul(hidden_size, intermediate_size));
    p.layer_norms = add(mul(2, hidden_size), qk_norm() ? mul(2, resolved_head_dim()) : 0);
    p.final_norm = hidden_size;
    p.head = tie_word_embeddings ? 0 : p.embedding;
    const std::int64_t layer = add(add(p.attention, p.mlp), p.layer_norms);
    p.total = add(add(add(p.embedding, mul(num_hidden_layers, layer)), p.final_norm), p.head);
    if (overflow) return std::nullopt;
    return p;
  }

  // The parameter count (embedding, layers, final norm, head); saturates at the int64 maximum for
  // a config whose count overflows, which validate() refuses.
  constexpr std::int64_t num_parameters() const {
    const auto counts = parameter_counts();
    return counts ? counts->total : std::numeric_limits<std::int64_t>::max();
  }

  friend constexpr bool operator==(const Config&, const Config&) = default;
};

// The size above which a config is refused before anything is allocated. Not the memory of this
// machine: a config describes the whole model, which FSDP and TP spread over many machines (and
// meshtorch-plan plans llama-3.1-405b on a laptop). The bound is what no run can hold: 10^13
// parameters, 40 TB of float32 weights, about 25 times llama-3.1-405b. Below it every size
// product fits int64 with room to spare, so the arithmetic on a valid config cannot overflow.
inline constexpr std::int64_t max_parameters = 10'000'000'000'000;
inline constexpr std::string_view too_many_parameters = "the model exceeds 10^13 parameters";

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
  if (c.sliding_window < 0) return "sliding_window must not be negative";
  if (c.sliding_window_from_layer < 0 || (c.sliding_window > 0 && c.sliding_window_from_layer >= c.num_hidden_layers))
    return "sliding_window_from_layer must name a layer";
  if (c.rope_scaling.kind == RopeScalingKind::llama3) {
    if (!(c.rope_scaling.factor >= 1)) return "rope_scaling.factor must be >= 1";
    if (!(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor))
      return "rope_scaling.high_freq_factor must exceed rope_scaling.low_freq_factor";
    if (c.rope_scaling.original_max_position_embeddings <= 0)
      return "rope_scaling.original_max_position_embeddings must be positive";
  }
  if (const auto counts = c.parameter_counts(); !counts || counts->total > max_parameters) return too_many_parameters;
  return std::nullopt;
}

namespace presets {

// The embedded default: byte-level vocabulary (256 bytes + bos/eos + padding to a multiple
// of 8, so TP up to 8 divides it), small enough to train on two CPU cores in minutes.
inline constexpr Config llama_tiny{.hidden_size = 128,
                                   .intermediate_size = 384,
                                   .num_hidden_layers = 4,
                                   .num_attention_heads = 8,
                                   .num_key_value_heads = 4,
                                   .vocab_size = 264,
                                   .rms_norm_eps = 1e-5,
                                   .rope_theta = 10000.0,
                                   .max_position_embeddings = 2048,
                                   .tie_word_embeddings = false,
                                   .initializer_range = 0.02,
                                   .bos_token_id = 256,
                                   .eos_token_id = 257};

inline constexpr RopeScaling llama31_rope{.kind = RopeScalingKind::llama3,
                                          .factor = 8.0,
                                          .low_freq_factor = 1.0,
                                          .high_freq_factor = 4.0,
                                          .original_max_position_embeddings = 8192};

// Published dimensions of Meta's checkpoints (their config.json files).
inline constexpr Config llama_3_2_1b{.hidden_size = 2048,
                                     .intermediate_size = 8192,
                                     .num_hidden_layers = 16,
                                     .num_attention_heads = 32,
                                     .num_key_value_heads = 8,
                                     .head_dim = 64,
                                     .vocab_size = 128256,
                                     .rms_norm_eps = 1e-5,
                                     .rope_theta = 500000.0,
                                     .rope_scaling = {.kind = RopeScalingKind::llama3,
                                                      .factor = 32.0,
                                                      .low_freq_factor = 1.0,
                                                      .high_freq_factor = 4.0,
                                                      .original_max_position_embeddings = 8192},
                                     .max_position_embeddings = 131072,
                                     .tie_word_embeddings = true,
                                     .initializer_range = 0.02,
                                     .bos_token_id = 128000,
                                     .eos_token_id = 128001};

inline constexpr Config llama_3_1_8b{.hidden_size = 4096,
                                     .intermediate_size = 14336,
                                     .num_hidden_layers = 32,
                                     .num_attention_heads = 32,
                                     .num_key_value_heads = 8,
                                     .head_dim = 128,
                                     .vocab_size = 128256,
                                     .rms_norm_eps = 1e-5,
                                     .rope_theta = 500000.0,
                                     .rope_scaling = llama31_rope,
                                     .max_position_embeddings = 131072,
                                     .tie_word_embeddings = false,
                                     .initializer_range = 0.02,
                                     .bos_token_id = 128000,
                                     .eos_token_id = 128001};

inline constexpr Config llama_3_1_70b{.hidden_size = 8192,
                                      .intermediate_size = 28672,
                                      .num_hidden_layers = 80,
                                      .num_attention_heads = 64,
                                      .num_key_value_heads = 8,
                                      .head_dim = 128,
                                      .vocab_size = 128256,
                                      .rms_norm_eps = 1e-5,
                                      .rope_theta = 500000.0,
                                      .rope_scaling = llama31_rope,
                                      .max_position_embeddings = 131072,
                                      .tie_word_embeddings = false,
                                      .initializer_range = 0.02,
                                      .bos_token_id = 128000,
                                      .eos_token_id = 128001};

inline constexpr Config llama_3_1_405b{.hidden_size = 16384,
                                       .intermediate_size = 53248,
                                       .num_hidden_layers = 126,
                                       .num_attention_heads = 128,
                                       .num_key_value_heads = 8,
                                       .head_dim = 128,
                                       .vocab_size = 128256,
                                       .rms_norm_eps = 1e-5,
                                       .rope_theta = 500000.0,
                                       .rope_scaling = llama31_rope,
                                       .max_position_embeddings = 131072,
                                       .tie_word_embeddings = false,
                                       .initializer_range = 0.02,
                                       .bos_token_id = 128000,
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

namespace detail {

// A byte count in decimal units ("1.5 GB").
MESHTORCH_DECL std::string human_bytes(double bytes);

// Why a config exceeds max_parameters: the count (in double, which cannot overflow for int64
// fields) and the field furthest above the largest preset's, which is the one to look at.
MESHTORCH_DECL std::string too_many_parameters_message(const Config& c, std::string_view source);

}  // namespace detail

// Throws ConfigError naming `source` and the first invalid field (first_invalid_field).
MESHTORCH_DECL void validate(const Config& c, std::string_view source = "config");

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <cstdio>
#include <iterator>

namespace meshtorch::llama {

namespace detail {

MESHTORCH_DECL std::string human_bytes(double bytes) {
  static constexpr const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
  std::size_t unit = 0;
  while (bytes >= 1000 && unit + 1 < std::size(units)) bytes /= 1000, ++unit;
  char text[48];
  std::snprintf(text, sizeof text, bytes >= 1000 ? "%.1e %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

MESHTORCH_DECL std::string too_many_parameters_message(const Config& c, std::string_view source) {
  const double hidden = static_cast<double>(c.hidden_size), head_dim = static_cast<double>(c.resolved_head_dim());
  const double heads = static_cast<double>(c.num_attention_heads) + static_cast<double>(c.num_key_value_heads);
  const double layer =
      hidden * 2 * head_dim * heads + 3 * hidden * static_cast<double>(c.intermediate_size) + 2 * hidden;
  const double embedding = static_cast<double>(c.vocab_size) * hidden;
  const double parameters =
      embedding * (c.tie_word_embeddings ? 1 : 2) + static_cast<double>(c.num_hidden_layers) * layer + hidden;
  struct Field {
    std::string_view name;
    std::int64_t value, largest;
    double ratio() const { return static_cast<double>(value) / static_cast<double>(largest); }
  };
  const auto& largest = presets::llama_3_1_405b;
  const Field fields[] = {{"hidden_size", c.hidden_size, largest.hidden_size},
                          {"intermediate_size", c.intermediate_size, largest.intermediate_size},
                          {"num_hidden_layers", c.num_hidden_layers, largest.num_hidden_layers},
                          {"vocab_size", c.vocab_size, largest.vocab_size},
                          {"num_attention_heads", c.num_attention_heads, largest.num_attention_heads},
                          {"head_dim", c.head_dim, largest.head_dim}};  // 0, never the culprit, when implied
  const auto& culprit = *std::max_element(std::begin(fields), std::end(fields),
                                          [](const Field& x, const Field& y) { return x.ratio() < y.ratio(); });
  char count[32];
  std::snprintf(count, sizeof count, "%.2g", parameters);
  return std::string(source) + ": " + std::string(culprit.name) + " " + std::to_string(culprit.value) +
         " makes a model of " + count + " parameters, which needs " + human_bytes(4 * parameters) +
         " of float32 weights; meshtorch refuses configs over 10^13 parameters (" +
         human_bytes(4 * static_cast<double>(max_parameters)) + " in float32), more than any run can hold";
}

}  // namespace detail

MESHTORCH_DECL void validate(const Config& c, std::string_view source) {
  if (auto problem = first_invalid_field(c)) {
    if (*problem == too_many_parameters) throw ConfigError(detail::too_many_parameters_message(c, source));
    throw ConfigError(std::string(source) + ": " + std::string(*problem));
  }
}

}  // namespace meshtorch::llama
#endif  // MESHTORCH_DEFINES(core)
