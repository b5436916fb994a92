#pragma once
// HF config.json <-> llama::Config. A malformed or inconsistent file gives a ConfigError that
// names the file and the field.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "meshtorch/models/llama/config.hpp"

namespace meshtorch::llama {

namespace detail {

inline std::string where(const std::string& source, std::string_view field) {
  return source + ": field '" + std::string(field) + "'";
}

template <class T>
T read_field(const nlohmann::json& j, std::string_view field, const std::string& source, std::optional<T> fallback) {
  const auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    throw ConfigError(where(source, field) + " is missing");
  }
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) throw ConfigError(where(source, field) + " must be true or false, got " + it->dump());
    return it->get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer())
      throw ConfigError(where(source, field) + " must be an integer, got " + it->dump());
    return it->get<T>();
  } else {
    if (!it->is_number()) throw ConfigError(where(source, field) + " must be a number, got " + it->dump());
    return it->get<T>();
  }
}

// HF writes eos_token_id as an int or a list of ints (Llama 3 instruct); the first one is ours.
inline std::int64_t read_token_id(const nlohmann::json& j, std::string_view field, const std::string& source,
                                  std::int64_t fallback) {
  const auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) return fallback;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) return (*it)[0].get<std::int64_t>();
  throw ConfigError(where(source, field) + " must be an integer or a list of integers, got " + it->dump());
}

}  // namespace detail

inline Config config_from_json(const nlohmann::json& j, const std::string& source = "config.json") {
  if (!j.is_object()) throw ConfigError(source + ": expected a JSON object at the top level");
  if (auto mt = j.find("model_type"); mt != j.end() && mt->is_string() && mt->get<std::string>() != "llama")
    throw ConfigError(detail::where(source, "model_type") + " is '" + mt->get<std::string>() +
                      "'; meshtorch's Llama model needs 'llama'");
  using detail::read_field;
  Config c;
  c.hidden_size = read_field<std::int64_t>(j, "hidden_size", source, std::nullopt);
  c.intermediate_size = read_field<std::int64_t>(j, "intermediate_size", source, std::nullopt);
  c.num_hidden_layers = read_field<std::int64_t>(j, "num_hidden_layers", source, std::nullopt);
  c.num_attention_heads = read_field<std::int64_t>(j, "num_attention_heads", source, std::nullopt);
  c.num_key_value_heads = read_field<std::int64_t>(j, "num_key_value_heads", source, c.num_attention_heads);
  c.head_dim = read_field<std::int64_t>(j, "head_dim", source, std::int64_t{0});
  c.vocab_size = read_field<std::int64_t>(j, "vocab_size", source, std::nullopt);
  c.rms_norm_eps = read_field<double>(j, "rms_norm_eps", source, 1e-6);
  c.rope_theta = read_field<double>(j, "rope_theta", source, 10000.0);
  c.max_position_embeddings = read_field<std::int64_t>(j, "max_position_embeddings", source, std::int64_t{2048});
  c.tie_word_embeddings = read_field<bool>(j, "tie_word_embeddings", source, false);
  c.initializer_range = read_field<double>(j, "initializer_range", source, 0.02);
  c.bos_token_id = detail::read_token_id(j, "bos_token_id", source, 1);
  c.eos_token_id = detail::read_token_id(j, "eos_token_id", source, 2);

  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    const std::string rs_source = source + ": rope_scaling";
    if (!rs->is_object()) throw ConfigError(detail::where(source, "rope_scaling") + " must be an object or null");
    auto type_it = rs->find("rope_type");
    if (type_it == rs->end()) type_it = rs->find("type");
    const std::string type = (type_it != rs->end() && type_it->is_string()) ? type_it->get<std::string>() : "";
    if (type == "llama3") {
      c.rope_scaling.kind = RopeScalingKind::llama3;
      c.rope_scaling.factor = read_field<double>(*rs, "factor", rs_source, std::nullopt);
      c.rope_scaling.low_freq_factor = read_field<double>(*rs, "low_freq_factor", rs_source, std::nullopt);
      c.rope_scaling.high_freq_factor = read_field<double>(*rs, "high_freq_factor", rs_source, std::nullopt);
      c.rope_scaling.original_max_position_embeddings =
          read_field<std::int64_t>(*rs, "original_max_position_embeddings", rs_source, std::nullopt);
    } else if (type != "default") {
      throw ConfigError(detail::where(source, "rope_scaling.rope_type") + " is '" + type +
                        "'; supported: 'llama3', 'default'");
    }
  }
  validate(c, source);
  return c;
}

inline Config load_config(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path.string() + ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  return config_from_json(j, path.string());
}

// Writes the fields transformers' LlamaConfig reads, so LlamaForCausalLM.from_pretrained loads it.
inline nlohmann::json config_to_json(const Config& c, std::string_view torch_dtype = "float32") {
  nlohmann::json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"vocab_size", c.vocab_size},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"max_position_embeddings", c.max_position_embeddings},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"initializer_range", c.initializer_range},
      {"bos_token_id", c.bos_token_id},
      {"eos_token_id", c.eos_token_id},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", 0.0},
      {"torch_dtype", std::string(torch_dtype)},
      {"use_cache", true},
  };
  if (c.head_dim != 0) j["head_dim"] = c.head_dim;  // absent means hidden_size / heads, as in HF
  if (c.rope_scaling.kind == RopeScalingKind::llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  return j;
}

// `-m` takes a preset name or a directory holding config.json.
inline Config resolve_model(const std::string& name_or_dir) {
  if (auto preset = presets::find(name_or_dir)) return *preset;
  const std::filesystem::path dir(name_or_dir);
  if (std::filesystem::is_directory(dir)) return load_config(dir / "config.json");
  if (std::filesystem::is_regular_file(dir) && dir.filename() == "config.json") return load_config(dir);
  std::string known;
  for (const auto& p : presets::all) known += (known.empty() ? "" : ", ") + std::string(p.name);
  throw ConfigError("-m/--model-name '" + name_or_dir + "' is neither a preset (" + known +
                    ") nor a directory with a config.json");
}

}  // namespace meshtorch::llama
