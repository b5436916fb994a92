#pragma once
// HF config.json <-> llama::Config. A malformed or inconsistent file gives a ConfigError that
// names the file and the field.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

// What a config.json says beyond the model's shape: the dtype its weights were saved in, and the
// fields that were read but do not change the computation here, which callers log once.
struct ConfigFile {
  Config config;
  std::optional<std::string> dtype;         // "float32", "bfloat16" or "float16", from dtype/torch_dtype
  std::vector<std::string> ignored_fields;  // e.g. "output_attentions", "rope_parameters.attention_factor"
};

// The config a parsed config.json describes (`source` names the file in errors).
MESHTORCH_DECL ConfigFile read_config_json(const nlohmann::json& j, const std::string& source = "config.json");
MESHTORCH_DECL Config config_from_json(const nlohmann::json& j, const std::string& source = "config.json");
// The same from a file; a directory or pipe named config.json, a number like 1e999, deep nesting
// or a repeated key is a ConfigError naming the file, not a raw exception.
MESHTORCH_DECL ConfigFile load_config_file(const std::filesystem::path& path);
MESHTORCH_DECL Config load_config(const std::filesystem::path& path);

// Writes what transformers 5 writes (rope_parameters, dtype) and, for transformers 4 readers, the
// same values under their earlier names (rope_theta, rope_scaling, torch_dtype); transformers 5
// reads such a file back to the same LlamaConfig.
MESHTORCH_DECL nlohmann::json config_to_json(const Config& c, std::string_view dtype = "float32");

// `-m` takes a preset name or a directory holding config.json. `ignored_fields` (if given) receives
// the file's fields that do not change the computation, for the caller to log once.
MESHTORCH_DECL Config resolve_model(const std::string& name_or_dir, std::vector<std::string>* ignored_fields = nullptr);

// The line a run logs once about -m's config.json fields that it does not read because they do not
// change the computation ("output_attentions", "rope_parameters.attention_factor"), or "" when
// there are none (and for a preset).
MESHTORCH_DECL std::string unread_config_fields_note(const std::string& name_or_dir);

// Token ids as config.json and generation_config.json write them (eos_token_id, which Llama 3
// instruct gives as a list): an id, a list of ids, or null (none). Anything else, a negative id
// included, is a ConfigError naming `where` (the file and field).
MESHTORCH_DECL std::vector<std::int64_t> token_ids(const nlohmann::json& value, const std::string& where);

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/io/json_file.hpp>
#include <meshtorch/io/model_folder.hpp>

namespace meshtorch::llama {

namespace detail {

inline std::string where(const std::string& source, std::string_view field) {
  return fmt::format("{}: field '{}'", source, field);
}

template <class T>
T read_field(const nlohmann::json& j, std::string_view field, const std::string& source, std::optional<T> fallback) {
  const auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    throw ConfigError(fmt::format("{} is missing", where(source, field)));
  }
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean())
      throw ConfigError(fmt::format("{} must be true or false, got {}", where(source, field), it->dump()));
    return it->get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer())
      throw ConfigError(fmt::format("{} must be an integer, got {}", where(source, field), it->dump()));
    return it->get<T>();
  } else {
    if (!it->is_number())
      throw ConfigError(fmt::format("{} must be a number, got {}", where(source, field), it->dump()));
    return it->get<T>();
  }
}

// HF writes eos_token_id as an int or a list of ints (Llama 3 instruct); the first one is ours.
inline std::int64_t read_token_id(const nlohmann::json& j, std::string_view field, const std::string& source,
                                  std::int64_t fallback) {
  const auto it = j.find(std::string(field));
  if (it == j.end() || it->is_null()) return fallback;
  const auto ids = token_ids(*it, where(source, field));
  if (ids.empty()) throw ConfigError(fmt::format("{} is an empty list", where(source, field)));
  return ids.front();
}

// Fields every writer adds that say nothing about the computation; not worth a log line.
inline bool is_bookkeeping_field(std::string_view name) {
  return name == "architectures" || name == "transformers_version" || name == "use_cache" || name == "pad_token_id" ||
         name == "_name_or_path" || name == "model_type";
}

inline std::optional<std::string> read_dtype(const nlohmann::json& j, const std::string& source) {
  std::optional<std::string> found;
  std::string found_in;
  // transformers 5 writes "dtype", earlier versions "torch_dtype"; 5 prefers "dtype" when both are there.
  for (const char* name : {"dtype", "torch_dtype"}) {
    const auto it = j.find(name);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string())
      throw ConfigError(fmt::format("{} must be a dtype name, got {}", where(source, name), it->dump()));
    auto value = it->get<std::string>();
    if (value.rfind("torch.", 0) == 0) value = value.substr(6);
    if (value != "float32" && value != "bfloat16" && value != "float16")
      throw ConfigError(fmt::format("{} is '{}'; supported: float32, bfloat16, float16", where(source, name), value));
    if (found && *found != value)
      throw ConfigError(
          fmt::format("{}: fields '{}' ('{}') and '{}' ('{}') disagree", source, found_in, *found, name, value));
    found = value;
    found_in = name;
  }
  return found;
}

// The rotary embedding: transformers 5's rope_parameters {"rope_type", "rope_theta", scaling
// fields}, or the earlier top-level rope_theta with rope_scaling. Either, both (when they agree),
// or neither (rope_theta 10000, no scaling). Types other than default and llama3 change the
// frequencies and are refused.
inline void read_rope(const nlohmann::json& j, const std::string& source, Config& c,
                      std::vector<std::string>& ignored) {
  struct Block {
    std::string name;
    std::optional<double> theta;
    RopeScaling scaling;
  };
  auto read_block = [&](const char* name) -> std::optional<Block> {
    const auto it = j.find(name);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_object()) throw ConfigError(fmt::format("{} must be an object or null", where(source, name)));
    const std::string block_source = fmt::format("{}: {}", source, name);
    Block block{name, std::nullopt, {}};
    std::string type = "default";
    for (const auto& [key, value] : it->items()) {
      const std::string field = fmt::format("{}.{}", name, key);
      if (key == "rope_type" || key == "type") {
        if (!value.is_string())
          throw ConfigError(fmt::format("{} must be a string, got {}", where(source, field), value.dump()));
        type = value.get<std::string>();
      } else if (key == "rope_theta") {
        block.theta = read_field<double>(*it, "rope_theta", block_source, std::nullopt);
      } else if (key == "partial_rotary_factor") {
        if (!value.is_number() || value.get<double>() != 1.0)
          throw ConfigError(
              fmt::format("{} is {}; rotary embeddings over part of each head are not implemented "
                          "(only 1.0)",
                          where(source, field), value.dump()));
      } else if (key != "factor" && key != "low_freq_factor" && key != "high_freq_factor" &&
                 key != "original_max_position_embeddings") {
        if (value.is_object())
          throw ConfigError(fmt::format("{}: rope parameters per layer type are not supported", where(source, field)));
        ignored.push_back(field);
      }
    }
    if (type == "llama3") {
      block.scaling.kind = RopeScalingKind::llama3;
      block.scaling.factor = read_field<double>(*it, "factor", block_source, std::nullopt);
      block.scaling.low_freq_factor = read_field<double>(*it, "low_freq_factor", block_source, std::nullopt);
      block.scaling.high_freq_factor = read_field<double>(*it, "high_freq_factor", block_source, std::nullopt);
      // transformers takes max_position_embeddings when the block leaves it out.
      block.scaling.original_max_position_embeddings =
          read_field<std::int64_t>(*it, "original_max_position_embeddings", block_source, c.max_position_embeddings);
    } else if (type == "default") {
      for (const char* key : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        if (it->contains(key)) ignored.push_back(fmt::format("{}.{}", name, key));
    } else {
      throw ConfigError(
          fmt::format("{} is '{}'; supported: 'default', 'llama3' (linear, dynamic, yarn and longrope "
                      "scaling are not implemented)",
                      where(source, fmt::format("{}.rope_type", name)), type));
    }
    return block;
  };
  const auto legacy = read_block("rope_scaling");
  const auto current = read_block("rope_parameters");
  std::optional<double> top_theta;
  if (j.contains("rope_theta") && !j["rope_theta"].is_null())
    top_theta = read_field<double>(j, "rope_theta", source, std::nullopt);
  if (auto it = j.find("partial_rotary_factor");
      it != j.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 1.0))
    throw ConfigError(fmt::format("{} is {}; rotary embeddings over part of each head are not implemented (only 1.0)",
                                  where(source, "partial_rotary_factor"), it->dump()));

  if (legacy && current && legacy->scaling != current->scaling)
    throw ConfigError(
        fmt::format("{}: fields 'rope_scaling' and 'rope_parameters' describe different rope scaling", source));
  const auto& block = current ? current : legacy;
  std::optional<double> theta = top_theta;
  std::string theta_from = "rope_theta";
  for (const auto* b : {&legacy, &current}) {
    if (!*b || !(*b)->theta) continue;
    const std::string field = fmt::format("{}.rope_theta", (*b)->name);
    if (theta && *theta != *(*b)->theta)
      throw ConfigError(
          fmt::format("{}: fields '{}' ({}) and '{}' ({}) disagree", source, theta_from, *theta, field, *(*b)->theta));
    theta = (*b)->theta;
    theta_from = field;
  }
  c.rope_theta = theta.value_or(10000.0);
  if (block) c.rope_scaling = block->scaling;
}

// model_type: the family, or a ConfigError naming what is supported. A missing model_type is a
// Llama (the first config.json files written for meshtorch had none).
inline Family read_family(const nlohmann::json& j, const std::string& source) {
  const auto it = j.find("model_type");
  if (it == j.end() || it->is_null()) return Family::llama;
  if (!it->is_string())
    throw ConfigError(fmt::format("{} must be a string, got {}", where(source, "model_type"), it->dump()));
  const auto type = it->get<std::string>();
  std::vector<std::string_view> supported;
  for (const Family family : all_families) {
    if (traits(family).model_type == type) return family;
    supported.push_back(traits(family).model_type);
  }
  throw ConfigError(
      fmt::format("{} is '{}'; supported: {}", where(source, "model_type"), type, fmt::join(supported, ", ")));
}

// The attention span, with transformers' defaults for a missing field. Mistral: sliding_window
// (absent: 4096, as MistralConfig; null: none). Qwen2 and Qwen3: a window only with use_sliding_window true
// (else transformers sets it to None), on the layers layer_types marks sliding, by default those
// from max_window_layers (absent: 28) on; none sliding, no window. The layers that slide are kept
// (Config::sliding_window_from_layer) so that config_to_json writes them back. Returns the fields
// it read.
inline std::vector<std::string> read_sliding_window(const nlohmann::json& j, const std::string& source, Config& c) {
  if (c.family == Family::mistral) {
    if (!j.contains("sliding_window")) {
      c.sliding_window = 4096;
    } else if (!j["sliding_window"].is_null()) {
      c.sliding_window = read_field<std::int64_t>(j, "sliding_window", source, std::nullopt);
      if (c.sliding_window <= 0)
        throw ConfigError(fmt::format("{} is {}; give a positive window or null", where(source, "sliding_window"),
                                      j["sliding_window"].dump()));
    }
    return {"sliding_window"};
  }
  if (!traits(c.family).qwen_window) return {};
  const std::vector<std::string> fields{"use_sliding_window", "layer_types", "sliding_window", "max_window_layers"};
  const bool windowed = read_field<bool>(j, "use_sliding_window", source, false);
  const auto first_by_count = read_field<std::int64_t>(j, "max_window_layers", source, std::int64_t{28});
  std::vector<bool> sliding(static_cast<std::size_t>(c.num_hidden_layers));
  if (const auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<std::int64_t>(it->size()) != c.num_hidden_layers)
      throw ConfigError(fmt::format("{} must be a list of num_hidden_layers ({}) entries", where(source, "layer_types"),
                                    c.num_hidden_layers));
    for (std::size_t i = 0; i < it->size(); ++i) {
      const auto& type = (*it)[i];
      if (type != "full_attention" && type != "sliding_attention")
        throw ConfigError(fmt::format("{} holds {}; supported: 'full_attention', 'sliding_attention'",
                                      where(source, "layer_types"), type.dump()));
      sliding[i] = type == "sliding_attention";
    }
  } else {
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) sliding[static_cast<std::size_t>(i)] = i >= first_by_count;
  }
  if (!windowed) return fields;
  const auto first = std::find(sliding.begin(), sliding.end(), true);
  if (first == sliding.end()) return fields;  // no layer slides
  if (std::find(first, sliding.end(), false) != sliding.end())
    throw ConfigError(
        fmt::format("{}: sliding layers followed by full ones are not supported (only full layers, "
                    "then sliding ones to the last)",
                    where(source, "layer_types")));
  c.sliding_window = read_field<std::int64_t>(j, "sliding_window", source, std::nullopt);
  if (c.sliding_window <= 0)
    throw ConfigError(fmt::format("{} is {}; sliding-window layers need a positive window",
                                  where(source, "sliding_window"), c.sliding_window));
  c.sliding_window_from_layer = first - sliding.begin();
  return fields;
}

}  // namespace detail

MESHTORCH_DECL ConfigFile read_config_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw ConfigError(fmt::format("{}: expected a JSON object at the top level", source));
  using detail::read_field;
  ConfigFile file;
  Config& c = file.config;
  c.family = detail::read_family(j, source);
  c.hidden_size = read_field<std::int64_t>(j, "hidden_size", source, std::nullopt);
  c.intermediate_size = read_field<std::int64_t>(j, "intermediate_size", source, std::nullopt);
  c.num_hidden_layers = read_field<std::int64_t>(j, "num_hidden_layers", source, std::nullopt);
  c.num_attention_heads = read_field<std::int64_t>(j, "num_attention_heads", source, std::nullopt);
  c.num_key_value_heads = read_field<std::int64_t>(j, "num_key_value_heads", source, c.num_attention_heads);
  // transformers' default: hidden_size / heads, but 128 for Qwen3 (Qwen3Config's).
  c.head_dim = read_field<std::int64_t>(j, "head_dim", source, std::int64_t{c.family == Family::qwen3 ? 128 : 0});
  c.vocab_size = read_field<std::int64_t>(j, "vocab_size", source, std::nullopt);
  c.rms_norm_eps = read_field<double>(j, "rms_norm_eps", source, 1e-6);
  c.max_position_embeddings = read_field<std::int64_t>(j, "max_position_embeddings", source, std::int64_t{2048});
  c.tie_word_embeddings = read_field<bool>(j, "tie_word_embeddings", source, false);
  c.initializer_range = read_field<double>(j, "initializer_range", source, 0.02);
  c.bos_token_id = detail::read_token_id(j, "bos_token_id", source, 1);
  c.eos_token_id = detail::read_token_id(j, "eos_token_id", source, 2);
  detail::read_rope(j, source, c, file.ignored_fields);
  file.dtype = detail::read_dtype(j, source);
  const auto window_fields = detail::read_sliding_window(j, source, c);

  // Fields that would change the computation and that the model does not implement.
  if (auto act = j.find("hidden_act"); act != j.end() && !act->is_null() && *act != "silu")
    throw ConfigError(
        fmt::format("{} is {}; only 'silu' is implemented", detail::where(source, "hidden_act"), act->dump()));
  // Qwen2's biases are its family's (on q, k and v), whatever attention_bias says: Qwen2Config has no such field.
  for (const char* name : {"attention_bias", "mlp_bias"})
    if (!(c.family == Family::qwen2 && std::string_view(name) == "attention_bias") &&
        read_field<bool>(j, name, source, false))
      throw ConfigError(
          fmt::format("{} is true; of the biases, only Qwen2's (on q, k and v, model_type qwen2) are implemented",
                      detail::where(source, name)));
  if (read_field<std::int64_t>(j, "pretraining_tp", source, std::int64_t{1}) > 1)
    throw ConfigError(
        fmt::format("{} is {}; only 1 is implemented (the tensor-parallel slicing of Llama 2's "
                    "pretraining is not)",
                    detail::where(source, "pretraining_tp"), j["pretraining_tp"].dump()));
  if (read_field<double>(j, "attention_dropout", source, 0.0) != 0.0)
    throw ConfigError(fmt::format("{} is {}; attention dropout is not implemented (only 0)",
                                  detail::where(source, "attention_dropout"), j["attention_dropout"].dump()));
  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null())
    throw ConfigError(
        fmt::format("{} is set; quantized weights are not supported", detail::where(source, "quantization_config")));

  static const std::set<std::string, std::less<>> read_here = {"hidden_size",
                                                               "intermediate_size",
                                                               "num_hidden_layers",
                                                               "num_attention_heads",
                                                               "num_key_value_heads",
                                                               "head_dim",
                                                               "vocab_size",
                                                               "rms_norm_eps",
                                                               "max_position_embeddings",
                                                               "tie_word_embeddings",
                                                               "initializer_range",
                                                               "bos_token_id",
                                                               "eos_token_id",
                                                               "rope_theta",
                                                               "rope_scaling",
                                                               "rope_parameters",
                                                               "partial_rotary_factor",
                                                               "dtype",
                                                               "torch_dtype",
                                                               "hidden_act",
                                                               "attention_bias",
                                                               "mlp_bias",
                                                               "pretraining_tp",
                                                               "attention_dropout",
                                                               "quantization_config"};
  for (const auto& [key, value] : j.items())
    if (!read_here.count(key) && !detail::is_bookkeeping_field(key) &&
        std::find(window_fields.begin(), window_fields.end(), key) == window_fields.end())
      file.ignored_fields.push_back(key);
  validate(c, source);
  return file;
}

MESHTORCH_DECL Config config_from_json(const nlohmann::json& j, const std::string& source) {
  return read_config_json(j, source).config;
}

MESHTORCH_DECL ConfigFile load_config_file(const std::filesystem::path& path) {
  return read_config_json(io::read_json_file<ConfigError>(path, "config.json"), path.string());
}

MESHTORCH_DECL Config load_config(const std::filesystem::path& path) { return load_config_file(path).config; }

MESHTORCH_DECL nlohmann::json config_to_json(const Config& c, std::string_view dtype) {
  const FamilyTraits family = traits(c.family);
  nlohmann::json j = {
      {"architectures", {std::string(family.architecture)}},
      {"model_type", std::string(family.model_type)},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"vocab_size", c.vocab_size},
      {"rms_norm_eps", c.rms_norm_eps},
      {"max_position_embeddings", c.max_position_embeddings},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"initializer_range", c.initializer_range},
      {"bos_token_id", c.bos_token_id},
      {"eos_token_id", c.eos_token_id},
      {"pad_token_id", nullptr},
      {"hidden_act", "silu"},
      {"attention_dropout", 0.0},
      {"dtype", std::string(dtype)},
      {"torch_dtype", std::string(dtype)},
      {"use_cache", true},
      {"rope_theta", c.rope_theta},
  };
  nlohmann::json rope = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  if (c.rope_scaling.kind == RopeScalingKind::llama3) {
    const nlohmann::json scaling = {
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling.factor},
        {"low_freq_factor", c.rope_scaling.low_freq_factor},
        {"high_freq_factor", c.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
    rope.update(scaling);
    j["rope_scaling"] = scaling;
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rope_parameters"] = rope;
  if (c.head_dim != 0) j["head_dim"] = c.head_dim;  // absent means hidden_size / heads, as in HF
  // Each family's own fields, as its transformers config writes them.
  switch (c.family) {
    case Family::llama:
      j.update({{"attention_bias", false}, {"mlp_bias", false}, {"pretraining_tp", 1}});
      break;
    case Family::mistral:
      j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
      break;
    case Family::qwen2:
    case Family::qwen3:
      if (c.family == Family::qwen3) j.update({{"attention_bias", false}, {"head_dim", c.resolved_head_dim()}});
      j.update({{"use_sliding_window", c.sliding_window > 0},
                {"sliding_window", c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr)}});
      {
        // The layers from the first sliding one on slide, as transformers derives them.
        const std::int64_t first = c.sliding_window > 0 ? c.sliding_window_from_layer : c.num_hidden_layers;
        std::vector<std::string> types;
        for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
          types.push_back(i >= first ? "sliding_attention" : "full_attention");
        j["max_window_layers"] = first;
        j["layer_types"] = types;
      }
      break;
  }
  return j;
}

MESHTORCH_DECL Config resolve_model(const std::string& name_or_dir, std::vector<std::string>* ignored_fields) {
  if (auto preset = presets::find(name_or_dir)) return *preset;
  const std::filesystem::path dir(name_or_dir);
  auto load = [&](const std::filesystem::path& path) {
    auto file = load_config_file(path);
    if (ignored_fields) *ignored_fields = std::move(file.ignored_fields);
    return file.config;
  };
  if (std::filesystem::is_directory(dir))
    return load(io::model_file(dir, "config.json", dir.string() + ": the config file"));
  if (std::filesystem::is_regular_file(dir) && dir.filename() == "config.json") return load(dir);
  std::vector<std::string_view> known;
  for (const auto& p : presets::all) known.push_back(p.name);
  throw ConfigError(fmt::format("-m/--model-name '{}' is neither a preset ({}) nor a directory with a config.json",
                                name_or_dir, fmt::join(known, ", ")));
}

MESHTORCH_DECL std::vector<std::int64_t> token_ids(const nlohmann::json& value, const std::string& where) {
  std::vector<std::int64_t> ids;
  if (value.is_null()) return ids;
  // An id indexes the vocabulary: a negative one (found by fuzzing --ids lines) is no token.
  const auto id_of = [&](const nlohmann::json& id) {
    if (!id.is_number_integer()) throw ConfigError(fmt::format("{} holds {}, not an integer", where, id.dump()));
    if (id.is_number_unsigned()
            ? id.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())
            : id.get<std::int64_t>() < 0)
      throw ConfigError(fmt::format("{} holds {}, not a token id (0 or more)", where, id.dump()));
    return id.get<std::int64_t>();
  };
  if (value.is_number_integer()) return {id_of(value)};
  if (!value.is_array())
    throw ConfigError(fmt::format("{} must be an integer, a list of integers or null, got {}", where, value.dump()));
  for (const auto& id : value) ids.push_back(id_of(id));
  return ids;
}

MESHTORCH_DECL std::string unread_config_fields_note(const std::string& name_or_dir) {
  std::vector<std::string> ignored;
  resolve_model(name_or_dir, &ignored);
  if (ignored.empty()) return {};
  return fmt::format("{}: {} field(s) not read, as they do not change the computation: {}", name_or_dir, ignored.size(),
                     fmt::join(ignored, ", "));
}

}  // namespace meshtorch::llama
#endif  // MESHTORCH_DEFINES(core)
