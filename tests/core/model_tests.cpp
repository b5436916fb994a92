// The Llama model, its config and its weight files.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/io/host_memory.hpp>
#include <meshtorch/meshtorch.hpp>

#include "test_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;
using meshtorch::testing::fresh_dir;

namespace {

void write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

mt::llama::Config small_gqa_config() {
  auto c = mt::llama::presets::llama_tiny;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 40;
  return c;
}

// A from-scratch forward pass written independently of model.hpp: explicit angles in double,
// the rotation as a 2x2 per frequency pair (in HF's half-split layout), repeated kv heads and
// an explicit causal mask instead of SDPA.
torch::Tensor reference_logits(mt::llama::LlamaForCausalLM& lm, const torch::Tensor& ids) {
  const auto& c = lm->config;
  const auto params = lm->named_parameters();
  auto p = [&](const std::string& name) { return params[name].to(torch::kDouble); };
  const auto S = ids.size(1), D = c.resolved_head_dim(), H = c.num_attention_heads, KV = c.num_key_value_heads;
  auto rms = [&](const torch::Tensor& x, const torch::Tensor& w) {
    return x / torch::sqrt(x.pow(2).mean(-1, true) + c.rms_norm_eps) * w;
  };
  auto angles = torch::empty({S, D / 2}, torch::kDouble);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < D / 2; ++i) angles[s][i] = static_cast<double>(s) / std::pow(c.rope_theta, 2.0 * i / D);
  auto rotate = [&](const torch::Tensor& x) {  // x: [B, h, S, D]
    auto a = x.narrow(-1, 0, D / 2), b = x.narrow(-1, D / 2, D / 2);
    auto cos = angles.cos(), sin = angles.sin();
    return torch::cat({a * cos - b * sin, b * cos + a * sin}, -1);
  };
  auto h = p("model.embed_tokens.weight").index_select(0, ids.flatten()).view({ids.size(0), S, -1});
  auto mask = torch::full({S, S}, -INFINITY, torch::kDouble).triu(1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const auto prefix = "model.layers." + std::to_string(l) + ".";
    auto x = rms(h, p(prefix + "input_layernorm.weight"));
    auto q = torch::matmul(x, p(prefix + "self_attn.q_proj.weight").t()).view({ids.size(0), S, H, D}).transpose(1, 2);
    auto k = torch::matmul(x, p(prefix + "self_attn.k_proj.weight").t()).view({ids.size(0), S, KV, D}).transpose(1, 2);
    auto v = torch::matmul(x, p(prefix + "self_attn.v_proj.weight").t()).view({ids.size(0), S, KV, D}).transpose(1, 2);
    q = rotate(q);
    k = rotate(k).repeat_interleave(H / KV, 1);
    v = v.repeat_interleave(H / KV, 1);
    auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(D)) + mask;
    auto attn = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({ids.size(0), S, H * D});
    h = h + torch::matmul(attn, p(prefix + "self_attn.o_proj.weight").t());
    x = rms(h, p(prefix + "post_attention_layernorm.weight"));
    auto gate = torch::matmul(x, p(prefix + "mlp.gate_proj.weight").t());
    auto up = torch::matmul(x, p(prefix + "mlp.up_proj.weight").t());
    h = h + torch::matmul(gate * torch::sigmoid(gate) * up, p(prefix + "mlp.down_proj.weight").t());
  }
  h = rms(h, p("model.norm.weight"));
  const auto head = c.tie_word_embeddings ? p("model.embed_tokens.weight") : p("lm_head.weight");
  return torch::matmul(h, head.t());
}

}  // namespace

TEST_CASE("the chunked loss equals the plain one, with its gradients, and chunks only when asked or large", "[model]") {
  auto c = small_gqa_config();
  c.tie_word_embeddings = true;  // the output projection is the embedding: two gradient paths
  auto run = [&](std::int64_t chunk) {
    torch::manual_seed(4);
    mt::llama::LlamaForCausalLM lm(c);
    mt::llama::init_weights(lm);
    lm->loss_chunk = chunk;
    auto ids = torch::randint(0, c.vocab_size, {3, 10}, torch::kLong);
    auto labels = ids.clone();
    labels.index_put_({0, torch::indexing::Slice(0, 4)}, -100);  // ignored positions
    auto loss = lm->loss(ids, labels);
    loss.backward();
    std::vector<torch::Tensor> out{loss.detach()};
    for (const auto& p : lm->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto plain = run(0);
  CHECK(plain[0].item<double>() ==
        Approx(([&] {
          torch::manual_seed(4);
          mt::llama::LlamaForCausalLM lm(c);
          mt::llama::init_weights(lm);
          auto ids = torch::randint(0, c.vocab_size, {3, 10}, torch::kLong);
          auto labels = ids.clone();
          labels.index_put_({0, torch::indexing::Slice(0, 4)}, -100);
          return mt::llama::LlamaForCausalLMImpl::causal_lm_loss(lm->forward(ids), labels).item<double>();
        })())
            .epsilon(1e-6));
  for (std::int64_t chunk : {1, 7, 29, 30, 1000}) {
    INFO("chunk " << chunk);
    const auto chunked = run(chunk);
    CHECK(chunked[0].item<double>() == Approx(plain[0].item<double>()).epsilon(1e-6));
    for (std::size_t i = 1; i < plain.size(); ++i) CHECK(torch::allclose(chunked[i], plain[i], 1e-5, 1e-7));
  }
  // Automatic: all at once up to 256 MiB of fp32 logits, else 64 MiB chunks (Llama 3's vocabulary
  // at 4096 positions: 130 positions per chunk; Llama 2's 32000: all 2048 positions at once
  // (250 MiB), 524 per chunk at 4096).
  CHECK(mt::loss_chunk_positions(-1, 4096, 128256) == 130);
  CHECK(mt::loss_chunk_positions(-1, 2048, 32000) == 2048);
  CHECK(mt::loss_chunk_positions(-1, 4096, 32000) == 524);
  CHECK(mt::loss_chunk_positions(-1, 2048, 256) == 2048);
  CHECK(mt::loss_chunk_positions(5, 3, 100) == 3);
  CHECK(mt::loss_chunk_positions(0, 10, 100) == 10);
}

TEST_CASE("model parameters carry HF Llama names and shapes", "[model]") {
  const auto c = small_gqa_config();
  mt::llama::LlamaForCausalLM lm(c);
  const auto params = lm->named_parameters();
  CHECK(params.size() == 1 + c.num_hidden_layers * 9 + 1 + 1);
  CHECK(params["model.embed_tokens.weight"].sizes() == torch::IntArrayRef{40, 32});
  CHECK(params["model.layers.1.self_attn.q_proj.weight"].sizes() == torch::IntArrayRef{32, 32});
  CHECK(params["model.layers.1.self_attn.k_proj.weight"].sizes() == torch::IntArrayRef{16, 32});
  CHECK(params["model.layers.0.mlp.down_proj.weight"].sizes() == torch::IntArrayRef{32, 48});
  CHECK(params["model.layers.0.post_attention_layernorm.weight"].sizes() == torch::IntArrayRef{32});
  CHECK(params["lm_head.weight"].sizes() == torch::IntArrayRef{40, 32});
  std::int64_t total = 0;
  for (const auto& p : lm->parameters()) total += p.numel();
  CHECK(total == c.num_parameters());

  auto tied = c;
  tied.tie_word_embeddings = true;
  mt::llama::LlamaForCausalLM tied_lm(tied);
  CHECK(tied_lm->named_parameters().find("lm_head.weight") == nullptr);
}

TEST_CASE("logits match an independent reference forward pass", "[model]") {
  torch::manual_seed(0);
  for (bool tied : {false, true}) {
    auto c = small_gqa_config();
    c.tie_word_embeddings = tied;
    mt::llama::LlamaForCausalLM lm(c);
    mt::llama::init_weights(lm);
    // Non-trivial norm weights so that the norms are really tested.
    torch::NoGradGuard no_grad;
    for (auto& [name, leaf] : mt::weight_modules(*lm))
      if (name.find("norm") != std::string::npos) leaf->weight.uniform_(0.5, 1.5);
    const auto ids = torch::randint(0, c.vocab_size, {2, 7}, torch::kLong);
    const auto ours = lm->forward(ids).to(torch::kDouble);
    const auto theirs = reference_logits(lm, ids);
    INFO("tied=" << tied << " max difference " << (ours - theirs).abs().max().item<double>());
    CHECK(torch::allclose(ours, theirs, 1e-5, 1e-5));
  }
}

TEST_CASE("loss of a zero output layer is ln(vocab_size)", "[model]") {
  auto c = small_gqa_config();
  mt::llama::LlamaForCausalLM lm(c);
  mt::llama::init_weights(lm);
  torch::NoGradGuard no_grad;
  lm->lm_head->weight.zero_();
  const auto ids = torch::randint(0, c.vocab_size, {3, 9}, torch::kLong);
  CHECK(lm->loss(ids, ids).item<double>() == Approx(std::log(40.0)).epsilon(1e-6));
}

TEST_CASE("loss is next-token cross entropy over all but the last position", "[model]") {
  torch::manual_seed(1);
  const auto logits = torch::randn({2, 5, 11});
  const auto labels = torch::randint(0, 11, {2, 5}, torch::kLong);
  double expected = 0;
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s < 4; ++s)
      expected -= torch::log_softmax(logits[b][s], 0)[labels[b][s + 1].item<int64_t>()].item<double>();
  expected /= 8;
  CHECK(mt::llama::LlamaForCausalLMImpl::causal_lm_loss(logits, labels).item<double>() ==
        Approx(expected).epsilon(1e-6));
}

TEST_CASE("llama3 rope scaling keeps high frequencies and divides low ones by the factor", "[model]") {
  const mt::llama::Rotary rotary(mt::llama::presets::llama_3_1_8b);
  auto scaled = rotary.inverse_frequencies(torch::kCPU);
  auto plain_config = mt::llama::presets::llama_3_1_8b;
  plain_config.rope_scaling = {};
  auto plain = mt::llama::Rotary(plain_config).inverse_frequencies(torch::kCPU);
  REQUIRE(scaled.size(0) == 64);
  CHECK(scaled[0].item<float>() == plain[0].item<float>());                // wavelength 2*pi: untouched
  CHECK(scaled[63].item<float>() == Approx(plain[63].item<float>() / 8));  // longest wavelength: / factor
  const auto between = scaled.gt(plain / 8).logical_and(scaled.lt(plain));
  CHECK(between.any().item<bool>());  // a smooth band in the middle
}

TEST_CASE("a model built on the meta device holds no memory until materialised", "[model]") {
  const auto c = mt::llama::presets::llama_3_1_8b;
  mt::llama::LlamaForCausalLM big(c, torch::TensorOptions().device(torch::kMeta));
  for (const auto& p : big->parameters()) CHECK(p.is_meta());

  auto small = small_gqa_config();
  mt::llama::LlamaForCausalLM lm(small, torch::TensorOptions().device(torch::kMeta));
  mt::llama::materialize(lm, torch::TensorOptions().device(torch::kCPU));
  for (const auto& item : lm->named_parameters()) {
    INFO(item.key());
    CHECK(item.value().device().is_cpu());
    CHECK(item.value().requires_grad());
  }
  CHECK(lm->model->norm->weight.eq(1).all().item<bool>());
  const auto std = lm->model->embed_tokens->weight.std().item<double>();
  CHECK(std == Approx(0.02).epsilon(0.1));
  // The forward pass uses the new storage.
  const auto ids = torch::randint(0, small.vocab_size, {1, 4}, torch::kLong);
  lm->loss(ids, ids).backward();
  CHECK(lm->model->embed_tokens->weight.grad().defined());
}

TEST_CASE("config.json parses HF fields and round-trips", "[config]") {
  const auto dir = fresh_dir("config");
  write(dir / "config.json", R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072, "tie_word_embeddings": false, "initializer_range": 0.02,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})");
  auto parsed = mt::llama::load_config(dir / "config.json");
  auto expected = mt::llama::presets::llama_3_1_8b;
  expected.head_dim = 0;  // the file leaves it implicit
  CHECK(parsed == expected);
  CHECK(mt::llama::resolve_model(dir.string()) == expected);
  CHECK(mt::llama::config_from_json(mt::llama::config_to_json(mt::llama::presets::llama_3_2_1b)) ==
        mt::llama::presets::llama_3_2_1b);
  CHECK(mt::llama::resolve_model("llama-3.1-405b").num_hidden_layers == 126);
  fs::remove_all(dir);
}

TEST_CASE("bad config.json files name the field at fault", "[config]") {
  const auto dir = fresh_dir("badconfig");
  const auto path = dir / "config.json";
  auto error_for = [&](const std::string& text) -> std::string {
    write(path, text);
    try {
      mt::llama::load_config(path);
    } catch (const mt::ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string base = R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 300)";
  CHECK_THAT(error_for("{" + base + "}"), Catch::Contains("'num_attention_heads' is missing"));
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": "8"})"),
             Catch::Contains("'num_attention_heads' must be an integer"));
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": 6})"),
             Catch::Contains("hidden_size must be divisible by num_attention_heads"));
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": 8, "num_key_value_heads": 3})"),
             Catch::Contains("multiple of num_key_value_heads"));
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": 8, "rope_scaling": {"rope_type": "yarn"}})"),
             Catch::Contains("rope_scaling.rope_type"));
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": 8, "model_type": "gpt2"})"),
             Catch::Contains("model_type"));
  CHECK_THAT(error_for(R"({"hidden_size": -64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 300,
                           "num_attention_heads": 8})"),
             Catch::Contains("hidden_size must be positive"));
  // A field given twice is refused, not silently the last one.
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": 8, "hidden_size": 128})"),
             Catch::Contains("names 'hidden_size' twice"));
  // A directory named config.json is a ConfigError naming it, not a raw stream error.
  std::filesystem::remove(path);
  std::filesystem::create_directory(path);
  CHECK_THROWS_WITH(mt::llama::load_config(path), Catch::Contains("not a regular file"));
  std::filesystem::remove(path);
  CHECK_THAT(error_for(R"({"hidden_size": 64,)"), Catch::Contains("not valid JSON"));
  CHECK_THAT(error_for("{" + base + R"(, "num_attention_heads": 8})"), Catch::Contains("no error"));
  CHECK_THROWS_WITH(mt::llama::resolve_model("no-such-model"), Catch::Contains("neither a preset"));
  fs::remove_all(dir);
}

TEST_CASE("config.json of each family: read, refused by name, written back as the same family", "[config]") {
  const std::string base = R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 300,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32)";
  const auto parse = [&](const std::string& fields) {
    return mt::llama::config_from_json(nlohmann::json::parse("{" + base + fields + "}"));
  };
  const auto error_for = [&](const std::string& fields) -> std::string {
    try {
      parse(fields);
    } catch (const mt::ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  // Qwen3: q/k norms per head, head_dim apart from hidden / heads, no window unless asked for.
  const auto qwen3 = parse(R"(, "model_type": "qwen3", "use_sliding_window": false, "sliding_window": null,
                              "max_window_layers": 28, "layer_types": ["full_attention", "full_attention"],
                              "attention_bias": false)");
  CHECK(qwen3.family == mt::llama::Family::qwen3);
  CHECK(qwen3.qk_norm());
  CHECK(qwen3.sliding_window == 0);
  // Each layer's norms: two of hidden_size, and q_norm and k_norm of head_dim.
  CHECK(qwen3.parameter_counts()->layer_norms == 2 * 64 + 2 * 32);
  // transformers' window: layers from max_window_layers (default 28) on, only with use_sliding_window.
  const auto qwen3_window =
      parse(R"(, "model_type": "qwen3", "use_sliding_window": true, "sliding_window": 96, "max_window_layers": 1)");
  CHECK(qwen3_window.sliding_window == 96);
  CHECK(qwen3_window.sliding_window_from_layer == 1);
  CHECK(parse(R"(, "model_type": "qwen3", "use_sliding_window": true, "sliding_window": 96)").sliding_window == 0);
  CHECK(parse(R"(, "model_type": "qwen3", "sliding_window": 96, "max_window_layers": 0)").sliding_window == 0);
  CHECK_THAT(error_for(R"(, "model_type": "qwen3", "use_sliding_window": true, "sliding_window": 8,
                          "layer_types": ["sliding_attention", "full_attention"])"),
             Catch::Contains("sliding layers followed by full ones are not supported"));
  // transformers' defaults for a missing head_dim: 128 for Qwen3, hidden / heads otherwise.
  const std::string without_head_dim = R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "vocab_size": 300, "num_attention_heads": 4, "num_key_value_heads": 2, "model_type": ")";
  CHECK(mt::llama::config_from_json(nlohmann::json::parse(without_head_dim + R"(qwen3"})")).resolved_head_dim() == 128);
  CHECK(mt::llama::config_from_json(nlohmann::json::parse(without_head_dim + R"(mistral"})")).resolved_head_dim() ==
        16);
  CHECK_THAT(error_for(R"(, "model_type": "qwen3", "use_sliding_window": true,
                          "layer_types": ["full_attention", "sliding_attention"])"),
             Catch::Contains("'sliding_window' is missing"));
  CHECK_THAT(error_for(R"(, "model_type": "qwen3", "layer_types": ["full_attention"])"),
             Catch::Contains("'layer_types' must be a list of num_hidden_layers (2) entries"));
  CHECK_THAT(error_for(R"(, "model_type": "qwen3", "attention_bias": true)"),
             Catch::Contains("'attention_bias' is true"));
  // Mistral: the window, or null.
  const auto mistral = parse(R"(, "model_type": "mistral", "sliding_window": 4096)");
  CHECK(mistral.family == mt::llama::Family::mistral);
  CHECK(!mistral.qk_norm());
  CHECK(mistral.sliding_window == 4096);
  CHECK(parse(R"(, "model_type": "mistral", "sliding_window": null)").sliding_window == 0);
  CHECK(parse(R"(, "model_type": "mistral")").sliding_window == 4096);  // MistralConfig's default
  CHECK_THAT(error_for(R"(, "model_type": "mistral", "sliding_window": 0)"),
             Catch::Contains("'sliding_window' is 0; give a positive window or null"));
  // A Llama's config does not have a window: a field it does not read is listed, not applied.
  mt::llama::ConfigFile llama_file =
      mt::llama::read_config_json(nlohmann::json::parse("{" + base + R"(, "sliding_window": 16})"));
  CHECK(llama_file.config.sliding_window == 0);
  CHECK(std::find(llama_file.ignored_fields.begin(), llama_file.ignored_fields.end(), "sliding_window") !=
        llama_file.ignored_fields.end());
  // Qwen2: biases on q, k and v whatever attention_bias says (Qwen2Config has no such field), and
  // Qwen3's window fields.
  const auto qwen2 = parse(R"(, "model_type": "qwen2", "attention_bias": false)");
  CHECK(qwen2.family == mt::llama::Family::qwen2);
  CHECK(qwen2.qkv_bias());
  CHECK(!qwen2.qk_norm());
  const auto qwen2_window = parse(R"(, "model_type": "qwen2", "use_sliding_window": true, "sliding_window": 64,
                                      "max_window_layers": 1)");
  CHECK(qwen2_window.sliding_window == 64);
  CHECK(qwen2_window.sliding_window_from_layer == 1);
  CHECK(parse(R"(, "model_type": "qwen2", "sliding_window": 64)").sliding_window == 0);  // not used without the flag
  // Token ids index the vocabulary: a negative one is refused (found by fuzzing --ids lines), as is an
  // integer past int64.
  CHECK_THAT(error_for(R"(, "eos_token_id": [2, -1])"), Catch::Contains("holds -1, not a token id (0 or more)"));
  CHECK_THAT(error_for(R"(, "bos_token_id": 18446744073709551615)"), Catch::Contains("not a token id"));
  CHECK(parse(R"(, "eos_token_id": [7, 9])").eos_token_id == 7);
  // Families not implemented, by name.
  CHECK_THAT(error_for(R"(, "model_type": "gemma")"),
             Catch::Contains("'model_type' is 'gemma'; supported: llama, mistral, qwen2, qwen3"));
  // Written back as the same family, with the fields its transformers class reads.
  for (const auto& config : {qwen3, qwen3_window, mistral, qwen2, qwen2_window}) {
    const auto written = mt::llama::config_to_json(config);
    CHECK(written["model_type"] == std::string(traits(config.family).model_type));
    CHECK(written["architectures"][0] == std::string(traits(config.family).architecture));
    CHECK(mt::llama::config_from_json(written) == config);
  }
  CHECK(mt::llama::config_to_json(qwen3)["sliding_window"].is_null());
  CHECK(mt::llama::config_to_json(mistral)["sliding_window"] == 4096);
}

TEST_CASE("a Qwen3 model normalises each head's q and k, and refuses sequences past a sliding window", "[model]") {
  auto config = mt::llama::presets::llama_tiny;
  config.family = mt::llama::Family::qwen3;
  config.head_dim = 32;  // apart from hidden_size / heads (16)
  torch::manual_seed(0);
  mt::llama::LlamaForCausalLM lm(config);
  mt::llama::init_weights(lm);
  auto& attention = *lm->model->decoder_layers[0]->self_attn;
  REQUIRE(attention.q_norm);
  CHECK(attention.q_norm->weight.sizes() == torch::IntArrayRef{32});
  const auto names = lm->named_parameters().keys();
  CHECK(std::count(names.begin(), names.end(), "model.layers.0.self_attn.q_norm.weight") == 1);
  CHECK(std::count(names.begin(), names.end(), "model.layers.3.self_attn.k_norm.weight") == 1);
  CHECK(lm->parameters().size() == 2 + 4 * 11 + 1);  // embedding, head, final norm; 11 weights a layer
  // The norms take part: scaling q_norm's weight changes the loss, and both get gradients.
  const auto ids = torch::randint(0, config.vocab_size, {2, 16});
  for (const bool fused : {true, false}) {
    lm->use_fused_kernels(fused);
    lm->zero_grad();
    const auto loss = lm->loss(ids, ids);
    loss.backward();
    CHECK(attention.q_norm->weight.grad().abs().sum().item<double>() > 0);
    CHECK(attention.k_norm->weight.grad().abs().sum().item<double>() > 0);
  }
  const double before = lm->loss(ids, ids).item<double>();
  {
    torch::NoGradGuard no_grad;
    attention.q_norm->weight.mul_(3.0);
  }
  CHECK(lm->loss(ids, ids).item<double>() != Approx(before).epsilon(1e-6));
  // A window shorter than the sequence: refused, naming the fix.
  config.sliding_window = 8;
  mt::llama::LlamaForCausalLM windowed(config);
  mt::llama::init_weights(windowed);
  CHECK_THROWS_WITH(windowed->loss(ids, ids),
                    Catch::Contains("a sequence of 16 positions is longer than the model's sliding_window (8)") &&
                        Catch::Contains("use sequences of at most 8 positions"));
  CHECK_NOTHROW(windowed->loss(ids.slice(1, 0, 8), ids.slice(1, 0, 8)));
}

TEST_CASE("a Qwen2 model adds a bias to q, k and v: named as transformers names it, zero at first, trained",
          "[model]") {
  auto config = mt::llama::presets::llama_tiny;
  config.family = mt::llama::Family::qwen2;
  torch::manual_seed(0);
  mt::llama::LlamaForCausalLM lm(config);
  mt::llama::init_weights(lm);
  auto& attention = *lm->model->decoder_layers[0]->self_attn;
  REQUIRE(attention.q_proj->bias.defined());
  CHECK(attention.q_proj->bias.sizes() == torch::IntArrayRef{config.q_size()});
  CHECK(attention.k_proj->bias.sizes() == torch::IntArrayRef{config.kv_size()});
  CHECK_FALSE(attention.o_proj->bias.defined());
  CHECK_FALSE(lm->model->decoder_layers[0]->mlp->gate_proj->bias.defined());
  CHECK(attention.v_proj->bias.abs().sum().item<double>() == 0);  // transformers' initialisation
  const auto names = lm->named_parameters().keys();
  for (const char* name : {"model.layers.0.self_attn.q_proj.bias", "model.layers.3.self_attn.k_proj.bias",
                           "model.layers.3.self_attn.v_proj.bias"})
    CHECK(std::count(names.begin(), names.end(), name) == 1);
  CHECK(std::count(names.begin(), names.end(), "model.layers.0.self_attn.o_proj.bias") == 0);
  std::int64_t elements = 0;
  for (const auto& parameter : lm->parameters()) elements += parameter.numel();
  CHECK(elements == config.num_parameters());
  // leaf_tensors() lists each bias right after its weight, as named_parameters() does.
  const auto tensors = mt::leaf_tensors(*lm);
  REQUIRE(tensors.size() == names.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) CHECK(tensors[i].name == names[i]);
  // The biases take part: they get gradients (fused and composite), and changing one changes the loss.
  const auto ids = torch::randint(0, config.vocab_size, {2, 16});
  for (const bool fused : {true, false}) {
    lm->use_fused_kernels(fused);
    lm->zero_grad();
    lm->loss(ids, ids).backward();
    for (auto* projection : {attention.q_proj.get(), attention.k_proj.get(), attention.v_proj.get()})
      CHECK(projection->bias.grad().abs().sum().item<double>() > 0);
  }
  const double before = lm->loss(ids, ids).item<double>();
  {
    torch::NoGradGuard no_grad;
    attention.v_proj->bias.fill_(0.5);
  }
  CHECK(lm->loss(ids, ids).item<double>() != Approx(before).epsilon(1e-6));
  // A copy of the leaf's bias (a loader's, FSDP's gathered one) is what forward adds.
  const auto replaced = torch::full_like(attention.v_proj->bias, 0.25);
  attention.v_proj->replace(mt::LeafSlot::bias, replaced);
  CHECK(lm->named_parameters()["model.layers.0.self_attn.v_proj.bias"].data_ptr() == replaced.data_ptr());
}

TEST_CASE("generation with a KV cache: the full forward's argmax, batched as alone, seeded sampling", "[generate]") {
  auto config = mt::llama::presets::llama_tiny;
  config.family = mt::llama::Family::qwen3;  // with the q/k norms
  torch::manual_seed(1);
  mt::llama::LlamaForCausalLM lm(config);
  mt::llama::init_weights(lm);
  {
    // Weights 10x HF's initialisation: logits far enough apart that rounding never flips an argmax.
    torch::NoGradGuard no_grad;
    for (auto& parameter : lm->parameters())
      if (parameter.dim() == 2) parameter.mul_(10.0);
  }
  const std::vector<std::vector<std::int64_t>> prompts{{5, 9, 13, 200, 7}, {42}, {3, 4, 5, 6, 7, 8, 9, 10, 11}};
  const mt::llama::GenerateOptions greedy{.max_new_tokens = 12};
  // Each prompt alone: every new token is the argmax of the whole sequence's forward (no cache).
  std::vector<std::vector<std::int64_t>> alone;
  for (const auto& prompt : prompts) {
    alone.push_back(mt::llama::generate(lm, {prompt}, greedy).at(0));
    REQUIRE(alone.back().size() == 12);
    auto sequence = prompt;
    torch::NoGradGuard no_grad;
    for (const auto token : alone.back()) {
      const auto logits = lm->forward(torch::tensor(sequence).unsqueeze(0));
      CHECK(logits[0][-1].argmax().item<std::int64_t>() == token);
      sequence.push_back(token);
    }
  }
  // Left-padded into one batch: the same tokens.
  CHECK(mt::llama::generate(lm, prompts, greedy) == alone);
  // LibTorch's GEMM instead of the few-rows kernel (--fused off) for every product: the same tokens.
  lm->use_fused_kernels(false);
  CHECK(mt::llama::generate(lm, prompts, greedy) == alone);
  lm->use_fused_kernels(true);
  // An eos ends a row, which keeps it; the others go on.
  auto until_eos = greedy;
  until_eos.eos_ids = {alone[0][3]};
  const auto stopped = mt::llama::generate(lm, prompts, until_eos);
  CHECK(stopped[0] == std::vector<std::int64_t>(alone[0].begin(), alone[0].begin() + 4));
  // Sampling: the seed fixes the tokens; top_k 1 is greedy.
  const mt::llama::GenerateOptions sampled{.max_new_tokens = 12, .temperature = 1.5, .top_p = 0.9, .seed = 7};
  const auto first = mt::llama::generate(lm, prompts, sampled);
  CHECK(mt::llama::generate(lm, prompts, sampled) == first);
  auto other_seed = sampled;
  other_seed.seed = 8;
  CHECK(mt::llama::generate(lm, prompts, other_seed) != first);
  auto top1 = sampled;
  top1.top_k = 1;
  CHECK(mt::llama::generate(lm, prompts, top1) == alone);
  // The cache is what the plan says.
  const mt::llama::KvCache cache(config, 3, 21, torch::TensorOptions().dtype(torch::kFloat));
  CHECK(cache.allocated_bytes() == mt::llama::KvCache::bytes(config, 3, 21, 4));
  CHECK(mt::llama::KvCache::bytes(config, 3, 21, 4) == 2 * 4 * 3 * 4 * 21 * 16 * 4);
  // Bad input by name.
  CHECK_THROWS_WITH(mt::llama::generate(lm, {{1, 999}}, greedy), Catch::Contains("prompt 0 holds token id 999"));
  CHECK_THROWS_WITH(mt::llama::generate(lm, {{}}, greedy), Catch::Contains("prompt 0 is empty"));
  // A cache larger than this process may take: refused before it is allocated.
  CHECK_THROWS_WITH(mt::llama::generate(lm, {{1, 2}}, {.max_new_tokens = 1'000'000'000'000}),
                    Catch::Contains("max_new_tokens, 1000000000000) needs") &&
                        Catch::Contains("ask for fewer new tokens or fewer prompts at once"));
}

TEST_CASE("safetensors round-trips tensors of every dtype", "[io]") {
  const auto dir = fresh_dir("st");
  mt::io::NamedTensors tensors{{"a", torch::randn({3, 4})},
                               {"b", torch::randn({5}).to(torch::kBFloat16)},
                               {"c", torch::arange(7, torch::kLong)},
                               {"d", torch::tensor({true, false})},
                               {"empty", torch::empty({0, 3})}};
  mt::io::save_safetensors(dir / "x.safetensors", tensors, {{"format", "pt"}});
  const auto loaded = mt::io::load_safetensors(dir / "x.safetensors");
  CHECK(loaded.metadata.at("format") == "pt");
  REQUIRE(loaded.tensors.size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    const auto* back = loaded.find(name);
    REQUIRE(back);
    CHECK(back->scalar_type() == t.scalar_type());
    CHECK(torch::equal(*back, t));
  }
  // No temporary files are left behind.
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  fs::remove_all(dir);
}

TEST_CASE("malformed safetensors files give an error naming the file and tensor", "[io]") {
  const auto dir = fresh_dir("badst");
  const auto path = dir / "bad.safetensors";
  auto with_header = [&](const std::string& header, std::size_t data_bytes) {
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
  };
  auto error = [&]() -> std::string {
    try {
      mt::io::load_safetensors(path);
    } catch (const mt::DataError& e) {
      return e.what();
    }
    return "no error";
  };
  write(path, "abc");
  CHECK_THAT(error(), Catch::Contains("too short"));
  with_header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4);
  CHECK_THAT(error(), Catch::Contains("'w'") && Catch::Contains("outside the data section"));
  with_header(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8);
  CHECK_THAT(error(), Catch::Contains("do not match shape and dtype"));
  with_header(R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", 8);
  CHECK_THAT(error(), Catch::Contains("unsupported dtype 'Q4'"));
  with_header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
              12);
  CHECK_THAT(error(), Catch::Contains("overlap"));
  with_header("{not json", 0);
  CHECK_THAT(error(), Catch::Contains("not valid JSON"));
  {
    std::ofstream out(path, std::ios::binary);
    const std::uint64_t n = 1ull << 40;
    out.write(reinterpret_cast<const char*>(&n), 8);
  }
  CHECK_THAT(error(), Catch::Contains("exceeds the file"));
  fs::remove_all(dir);
}

TEST_CASE("a saved model folder loads back into a fresh model with equal weights", "[io]") {
  const auto dir = fresh_dir("pretrained");
  torch::manual_seed(3);
  mt::llama::LlamaForCausalLM saved(small_gqa_config());
  mt::llama::init_weights(saved);
  mt::llama::save_pretrained(saved, dir);
  CHECK(mt::llama::load_config(dir / "config.json") == saved->config);

  mt::llama::LlamaForCausalLM loaded(mt::llama::resolve_model(dir.string()));
  CHECK(mt::llama::load_pretrained_weights_if_present(loaded, dir));
  const auto a = saved->named_parameters(), b = loaded->named_parameters();
  for (const auto& item : a) CHECK(torch::equal(item.value(), b[item.key()]));
  // A preset name or a folder with only a config.json leaves the initialisation alone.
  CHECK_FALSE(mt::llama::load_pretrained_weights_if_present(loaded, "llama-tiny"));
  const auto config_only = fresh_dir("config-only");
  mt::io::write_file_atomically(config_only / "config.json", mt::llama::config_to_json(saved->config).dump());
  CHECK_FALSE(mt::llama::load_pretrained_weights_if_present(loaded, config_only));
  fs::remove_all(config_only);

  auto other = small_gqa_config();
  other.intermediate_size = 64;
  mt::llama::LlamaForCausalLM mismatched(other);
  CHECK_THROWS_WITH(mt::llama::load_pretrained_weights(mismatched, dir),
                    Catch::Contains("mlp") && Catch::Contains("has shape"));

  // A weight stored as I32 was value-cast and trained (loss 5.587 instead of 5.533): refused,
  // naming it, by the loader every path shares (chapter 1, parallelize, FSDP).
  auto tensors = mt::io::load_safetensors(dir / "model.safetensors").tensors;
  const auto& name = tensors.front().first;
  tensors.front().second = tensors.front().second.mul(100).to(torch::kInt);
  mt::io::save_safetensors(dir / "model.safetensors", tensors);
  CHECK_THROWS_WITH(mt::llama::load_pretrained_weights(loaded, dir),
                    (dir / "model.safetensors").string() + ": tensor '" + name +
                        "' is stored as Int, not a floating-point dtype; the model's weights are floating point (F32, "
                        "F16, BF16 or F64) and converting it would train on its integer values");
  fs::remove_all(dir);
}

// Issue 38, fault 10: a config.json of 10,000,000 layers beside weights of 4 (2.1e12 parameters,
// under max_parameters) was built until the kernel killed the process.
TEST_CASE("a model too large for this process's memory is refused before anything is built", "[model]") {
  const auto memory = mt::io::available_host_memory();
  REQUIRE(memory);  // Linux: /proc/meminfo
  CHECK(memory->available_bytes > 0);
  const auto dir = fresh_dir("too-many-layers");
  mt::llama::LlamaForCausalLM saved(mt::llama::presets::llama_tiny);
  mt::llama::save_pretrained(saved, dir);
  auto config = mt::llama::config_to_json(saved->config);
  config["num_hidden_layers"] = 10'000'000;  // the modules alone: 10^7 x 16 kB, on any device
  mt::io::write_file_atomically(dir / "config.json", config.dump());
  const auto start = std::chrono::steady_clock::now();
  for (const auto device : {torch::kCPU, torch::kMeta}) {
    INFO(device);
    CHECK_THROWS_AS(
        mt::llama::LlamaForCausalLM(mt::llama::resolve_model(dir.string()), torch::TensorOptions().device(device)),
        mt::ConfigError);
    CHECK_THROWS_WITH(
        mt::llama::LlamaForCausalLM(mt::llama::resolve_model(dir.string()), torch::TensorOptions().device(device)),
        Catch::Contains("num_hidden_layers 10000000") && Catch::Contains("this process may take") &&
            Catch::Contains(memory->source));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));

  // On the CPU the weights count too: twice what this process may take, in few enough layers
  // that their modules alone would fit.
  auto big = mt::llama::presets::llama_tiny;
  const auto per_layer = big.parameter_counts()->total / big.num_hidden_layers;  // about, and enough
  big.num_hidden_layers = static_cast<std::int64_t>(2 * memory->available_bytes / (4 * per_layer)) + 1;
  if (!mt::llama::first_invalid_field(big)) {
    CHECK_THROWS_WITH(mt::llama::LlamaForCausalLM(big),
                      Catch::Contains("of Float weights") && Catch::Contains("meta device"));
    // The same config on the meta device takes only its modules: built when they fit.
    if (static_cast<std::uint64_t>(big.num_hidden_layers) * mt::llama::layer_module_bytes < memory->available_bytes / 4)
      CHECK_NOTHROW(mt::llama::LlamaForCausalLM(big, torch::TensorOptions().device(torch::kMeta)));
  }
  fs::remove_all(dir);
}

TEST_CASE("context parallel's head-tail split gives every rank the same causal work, and names the lengths that split",
          "[cp]") {
  namespace cp = mt::cp;
  for (int ranks : {1, 2, 4, 8}) {
    INFO(ranks << " ranks");
    for (int r = 0; r < ranks; ++r) CHECK(cp::causal_work(r, ranks) == cp::causal_work(0, ranks));
    // Every chunk held exactly once.
    std::vector<int> held(static_cast<std::size_t>(2 * ranks), 0);
    for (int r = 0; r < ranks; ++r)
      for (int chunk : cp::chunks_of(r, ranks)) ++held[static_cast<std::size_t>(chunk)];
    CHECK(std::ranges::all_of(held, [](int n) { return n == 1; }));
  }
  static_assert(cp::chunks_of(1, 4) == std::array<int, 2>{1, 6});
  CHECK(cp::sequence_split_problem(4096, 4).empty());
  CHECK(cp::sequence_split_problem(4100, 4) ==
        "-s/--seq-length 4100 does not split into 2 x --cp 4 equal chunks (context parallel's balanced causal "
        "split); use a multiple of 8: 4096 or 4104");
  CHECK(cp::sequence_split_problem(100, 2, 2).empty());  // each rank's 50 positions split over TP 2
  CHECK(cp::sequence_split_problem(100, 2, 4) ==
        "-s/--seq-length 100 does not split into 2 x --cp 2 equal chunks with each rank's positions a multiple of "
        "--tp 4 (context parallel's balanced causal split); use a multiple of 8: 96 or 104");
}

// The blockwise attention under context parallel's ring, in one process: each of N simulated ranks
// holds its two head-tail chunks of the queries and meets every key/value chunk; the merged
// outputs, put back in sequence order, are causal attention over the whole sequence, and the
// gradients of q, k and v (each rank's summed) are its gradients.
TEST_CASE("blockwise attention merged by log-sum-exp equals causal attention, values and gradients", "[cp]") {
  namespace cp = mt::cp;
  torch::manual_seed(3);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int ranks : {1, 2, 4}) {
      for (const std::int64_t kv_heads : {4, 2}) {  // multi-head, and grouped-query
        INFO(c10::toString(dtype) << ", " << ranks << " ranks, " << kv_heads << " key/value heads");
        const std::int64_t batch = 2, heads = 4, chunk = 5, dim = 8, seq = 2 * ranks * chunk;
        const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
        const auto options = torch::TensorOptions().dtype(dtype);
        const auto q = torch::randn({batch, heads, seq, dim}, options).requires_grad_(true);
        const auto k = torch::randn({batch, kv_heads, seq, dim}, options).requires_grad_(true);
        const auto v = torch::randn({batch, kv_heads, seq, dim}, options).requires_grad_(true);
        const auto grad = torch::randn({batch, heads, seq, dim}, options);

        const auto expected = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale,
                                                               /*enable_gqa=*/kv_heads < heads);
        expected.backward(grad);
        const auto expected_dq = q.grad().clone(), expected_dk = k.grad().clone(), expected_dv = v.grad().clone();
        q.mutable_grad() = torch::Tensor();
        k.mutable_grad() = torch::Tensor();
        v.mutable_grad() = torch::Tensor();

        std::vector<torch::Tensor> key_chunks, value_chunks;
        std::vector<int> all_chunks;
        for (int c = 0; c < 2 * ranks; ++c) {
          key_chunks.push_back(k.narrow(2, c * chunk, chunk));
          value_chunks.push_back(v.narrow(2, c * chunk, chunk));
          all_chunks.push_back(c);
        }
        std::vector<torch::Tensor> outputs(static_cast<std::size_t>(2 * ranks));
        for (int r = 0; r < ranks; ++r) {
          const auto held = cp::chunks_of(r, ranks);
          const std::vector<int> q_chunks(held.begin(), held.end());
          std::vector<torch::Tensor> queries;
          for (int c : q_chunks) queries.push_back(q.narrow(2, c * chunk, chunk));
          const auto out = cp::attend_chunks(queries, q_chunks, key_chunks, value_chunks, all_chunks, scale);
          outputs[static_cast<std::size_t>(held[0])] = out.narrow(2, 0, chunk);
          outputs[static_cast<std::size_t>(held[1])] = out.narrow(2, chunk, chunk);
        }
        const auto got = torch::cat(outputs, 2);
        got.backward(grad);
        const double tolerance = dtype == torch::kFloat ? 1e-5 : 2e-2;
        const auto relative = [](const torch::Tensor& a, const torch::Tensor& b) {
          return ((a.to(torch::kFloat) - b.to(torch::kFloat)).abs().max() / b.to(torch::kFloat).abs().max())
              .item<double>();
        };
        CHECK(relative(got, expected) < tolerance);
        CHECK(relative(q.grad(), expected_dq) < tolerance);
        CHECK(relative(k.grad(), expected_dk) < tolerance);
        CHECK(relative(v.grad(), expected_dv) < tolerance);
      }
    }
  }
}
