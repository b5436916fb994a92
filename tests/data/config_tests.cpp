// config.json generations: transformers 5 (rope_parameters, dtype) and earlier (top-level
// rope_theta, rope_scaling, torch_dtype) parse to the same Config; each field that would change
// the computation and is not implemented is refused by name; unknown harmless fields are listed.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/models/llama/config_json.hpp>

namespace mt = meshtorch;
using nlohmann::json;

namespace {

// A GQA config with head_dim not hidden/heads and llama3 rope, as transformers 5.24 writes it.
json transformers5_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": 2, "head_dim": 24, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 2048,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
    "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 64, "rope_theta": 50000.0, "rope_type": "llama3"},
    "tie_word_embeddings": false, "transformers_version": "5.24.0", "use_cache": true, "vocab_size": 300})");
}

// The same model as transformers 4 wrote it.
json transformers4_config() {
  auto j = transformers5_config();
  j.erase("rope_parameters");
  j.erase("dtype");
  j["rope_theta"] = 50000.0;
  j["rope_scaling"] = {{"factor", 8.0},
                       {"high_freq_factor", 4.0},
                       {"low_freq_factor", 1.0},
                       {"original_max_position_embeddings", 64},
                       {"rope_type", "llama3"}};
  j["torch_dtype"] = "bfloat16";
  j["transformers_version"] = "4.46.0";
  return j;
}

std::string error_for(const json& j) {
  try {
    mt::llama::read_config_json(j, "config.json");
  } catch (const mt::ConfigError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("config.json of transformers 5 and of transformers 4 give the same Config", "[config]") {
  const auto v5 = mt::llama::read_config_json(transformers5_config());
  const auto v4 = mt::llama::read_config_json(transformers4_config());
  CHECK(v5.config == v4.config);
  CHECK(v5.config.rope_theta == 50000.0);
  CHECK(v5.config.head_dim == 24);
  CHECK(v5.config.num_key_value_heads == 2);
  CHECK(v5.config.rope_scaling.kind == mt::llama::RopeScalingKind::llama3);
  CHECK(v5.config.rope_scaling.factor == 8.0);
  CHECK(v5.config.rope_scaling.original_max_position_embeddings == 64);
  CHECK(v5.dtype == "bfloat16");
  CHECK(v4.dtype == "bfloat16");
  CHECK(v5.ignored_fields.empty());
  CHECK(v4.ignored_fields.empty());

  // rope_theta in rope_parameters alone (the regression: it used to fall back to 10000).
  auto plain = transformers5_config();
  plain["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  const auto parsed = mt::llama::config_from_json(plain);
  CHECK(parsed.rope_theta == 500000.0);
  CHECK(parsed.rope_scaling.kind == mt::llama::RopeScalingKind::none);

  // Neither: transformers' default theta.
  plain.erase("rope_parameters");
  CHECK(mt::llama::config_from_json(plain).rope_theta == 10000.0);

  // llama3 without original_max_position_embeddings takes max_position_embeddings, as transformers does.
  auto implicit = transformers5_config();
  implicit["rope_parameters"].erase("original_max_position_embeddings");
  CHECK(mt::llama::config_from_json(implicit).rope_scaling.original_max_position_embeddings == 2048);
}

TEST_CASE("a written config.json reads back to the same Config in both generations' fields", "[config]") {
  const auto config = mt::llama::read_config_json(transformers5_config()).config;
  const auto written = mt::llama::config_to_json(config, "bfloat16");
  CHECK(mt::llama::config_from_json(written) == config);
  // transformers 5's fields...
  CHECK(written["rope_parameters"]["rope_theta"] == 50000.0);
  CHECK(written["rope_parameters"]["rope_type"] == "llama3");
  CHECK(written["dtype"] == "bfloat16");
  // ...and transformers 4's, with the same values.
  CHECK(written["rope_theta"] == 50000.0);
  CHECK(written["rope_scaling"]["factor"] == 8.0);
  CHECK(written["torch_dtype"] == "bfloat16");
  // Each generation's fields alone also read back to it.
  auto only_v5 = written;
  only_v5.erase("rope_theta");
  only_v5.erase("rope_scaling");
  auto only_v4 = written;
  only_v4.erase("rope_parameters");
  CHECK(mt::llama::config_from_json(only_v5) == config);
  CHECK(mt::llama::config_from_json(only_v4) == config);
  for (const auto& preset : mt::llama::presets::all) {
    INFO(preset.name);
    CHECK(mt::llama::config_from_json(mt::llama::config_to_json(preset.config)) == preset.config);
  }
}

TEST_CASE("each field that would change the computation and is not implemented is refused by name", "[config]") {
  auto with = [](const char* field, json value) {
    auto j = transformers5_config();
    j[field] = std::move(value);
    return error_for(j);
  };
  CHECK(error_for(transformers5_config()) == "no error");
  CHECK_THAT(with("attention_bias", true), Catch::Contains("field 'attention_bias' is true"));
  CHECK_THAT(with("mlp_bias", true), Catch::Contains("field 'mlp_bias' is true"));
  CHECK_THAT(with("hidden_act", "gelu"), Catch::Contains("field 'hidden_act' is \"gelu\""));
  CHECK_THAT(with("pretraining_tp", 2), Catch::Contains("field 'pretraining_tp' is 2"));
  CHECK_THAT(with("attention_dropout", 0.1), Catch::Contains("field 'attention_dropout'"));
  CHECK_THAT(with("partial_rotary_factor", 0.5), Catch::Contains("field 'partial_rotary_factor'"));
  CHECK_THAT(with("quantization_config", {{"quant_method", "bitsandbytes"}}),
             Catch::Contains("field 'quantization_config'"));
  CHECK_THAT(with("dtype", "int8"), Catch::Contains("field 'dtype' is 'int8'"));
  for (const char* type : {"linear", "dynamic", "yarn", "longrope"}) {
    INFO(type);
    CHECK_THAT(with("rope_parameters", {{"rope_type", type}, {"rope_theta", 10000.0}, {"factor", 2.0}}),
               Catch::Contains("field 'rope_parameters.rope_type' is '" + std::string(type) + "'"));
    auto v4 = transformers4_config();
    v4["rope_scaling"] = {{"type", type}, {"factor", 2.0}};
    CHECK_THAT(error_for(v4), Catch::Contains("field 'rope_scaling.rope_type' is '" + std::string(type) + "'"));
  }
  CHECK_THAT(with("rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 10000.0}}),
             Catch::Contains("rope_parameters: field 'factor' is missing"));
  CHECK_THAT(with("rope_parameters", {{"full_attention", {{"rope_type", "default"}}}}),
             Catch::Contains("rope parameters per layer type"));
  // Two generations that disagree are ambiguous.
  auto both = transformers5_config();
  both["rope_theta"] = 10000.0;
  CHECK_THAT(error_for(both), Catch::Contains("'rope_theta'") && Catch::Contains("'rope_parameters.rope_theta'") &&
                                  Catch::Contains("disagree"));
  auto dtypes = transformers5_config();
  dtypes["torch_dtype"] = "float32";
  CHECK_THAT(error_for(dtypes), Catch::Contains("'dtype'") && Catch::Contains("'torch_dtype'"));
  // Harmless settings stay allowed: false biases, tp 1, silu.
  auto harmless = transformers5_config();
  harmless["pretraining_tp"] = 1;
  harmless["partial_rotary_factor"] = 1.0;
  CHECK(error_for(harmless) == "no error");
}

TEST_CASE("unknown fields that do not change the computation are listed once", "[config]") {
  auto j = transformers5_config();
  j["output_attentions"] = false;
  j["my_custom_note"] = "x";
  j["rope_parameters"]["attention_factor"] = 1.0;
  const auto file = mt::llama::read_config_json(j);
  CHECK(file.ignored_fields ==
        std::vector<std::string>{"rope_parameters.attention_factor", "my_custom_note", "output_attentions"});

  // resolve_model hands them out too, from a folder's config.json.
  const auto dir = std::filesystem::temp_directory_path() / ("meshtorch-config-ignored-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << j.dump();
  std::vector<std::string> ignored;
  CHECK(mt::llama::resolve_model(dir.string(), &ignored) == file.config);
  CHECK(ignored == file.ignored_fields);
  // The line the Experiment logs once on rank 0; none for a preset.
  CHECK(mt::llama::unread_config_fields_note(dir.string()) ==
        dir.string() +
            ": 3 field(s) not read, as they do not change the computation: "
            "rope_parameters.attention_factor, my_custom_note, output_attentions");
  CHECK(mt::llama::unread_config_fields_note("llama-tiny").empty());
  std::filesystem::remove_all(dir);
}
