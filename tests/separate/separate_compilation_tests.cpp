// The functions that <meshtorch/src/core.hpp> compiles once, called from a program that sees only
// their declarations: each links, and each does what the header-only build does.
#include <meshtorch/meshtorch.hpp>

// What separate compilation is for: the umbrella header no longer parses nlohmann-json's parser.
// A compile-time check: this program does not build if it does.
#if defined(INCLUDE_NLOHMANN_JSON_HPP_)
#error "with MESHTORCH_SEPARATE_COMPILATION, <meshtorch/meshtorch.hpp> includes <nlohmann/json.hpp>"
#endif
// Nor fmt's engine: meshtorch_compiled_library() compiles it once, in src/core.hpp.
#if defined(FMT_HEADER_ONLY)
#error "meshtorch_compiled_library() gave this program FMT_HEADER_ONLY; fmt's engine belongs in src/core.hpp"
#endif

#include <chrono>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/comm/init.hpp>

#include "../core/test_support.hpp"
#include "../input/input_support.hpp"

namespace mt = meshtorch;
using mt::testing::fresh_dir;
using mt::testing::write_file;

namespace {

// The message of what `f` throws, which must be an `Error`.
template <class Error, class F>
std::string error_of_type(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("a model folder written and read through the separately compiled functions") {
  const auto dir = fresh_dir("separate-model");
  auto config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 1;
  mt::llama::LlamaForCausalLM model(config);
  mt::llama::init_weights(model);
  mt::llama::save_pretrained(model, dir);  // config_to_json, save_safetensors

  const auto loaded = mt::llama::load_config(dir / "config.json");  // read_json_file, read_config_json
  CHECK(loaded.hidden_size == config.hidden_size);
  CHECK(loaded.num_hidden_layers == 1);
  CHECK(mt::llama::config_to_json(loaded, "float32") == mt::llama::config_to_json(config, "float32"));
  CHECK(mt::llama::resolve_model(dir.string()).vocab_size == config.vocab_size);
  const auto readers = mt::llama::open_weight_files(dir);
  REQUIRE(readers.size() == 1);
  CHECK(readers.front().path() == dir / "model.safetensors");

  mt::llama::LlamaForCausalLM copy(config);
  mt::llama::load_pretrained_weights(copy, dir);  // parse_header
  const auto ids = torch::randint(0, config.vocab_size, {1, 8}, torch::kLong);
  CHECK(copy->loss(ids, ids).item<double>() == model->loss(ids, ids).item<double>());

  write_file(dir / "config.json", R"({"hidden_size": 64, "hidden_size": 128})");
  CHECK(error_of_type<mt::ConfigError>([&] { mt::llama::load_config(dir / "config.json"); }) ==
        (dir / "config.json").string() + ": config.json names 'hidden_size' twice");
}

TEST_CASE("state.json and metrics.jsonl through the separately compiled functions") {
  const auto dir = fresh_dir("separate-state");
  mt::train::TrainState state;
  state.global_step = 7;
  state.epoch_step = 7;
  state.running_loss = 2.5;
  state.running_steps = 1;
  const mt::train::RunIdentity identity{1, 128, 8, "builtin", "llama-tiny"};
  write_file(dir / "state.json", mt::train::to_json(state, identity).dump());
  const auto read = mt::train::read_train_state(dir, identity);
  CHECK(read.global_step == 7);
  CHECK(read.running_loss == 2.5);
  auto other = identity;
  other.seed = 2;
  CHECK(error_of_type<mt::ConfigError>([&] {
          mt::train::read_train_state(dir, other);
        }).find("written with seed = 1, this run has 2") != std::string::npos);

  mt::train::MetricsFile metrics(dir / "metrics.jsonl");
  for (int step = 1; step <= 3; ++step) metrics.append(nlohmann::ordered_json{{"global_step", step}, {"loss", 0.5}});
  CHECK(metrics.set_aside_after(1) == 2);
  CHECK(mt::train::format_metrics(nlohmann::ordered_json{{"global_step", 1}, {"loss", 0.123456}}) ==
        "global_step=1, loss=0.1235");

  mt::train::LogWindow window(torch::kCPU, /*tokens_per_step=*/1024);
  mt::train::PhaseTimers timers(torch::kCPU);
  const auto record = window.record(state, /*steps_per_epoch=*/10, /*lr=*/1e-3, timers);
  CHECK(record.at("global_step") == 7);
  CHECK(record.at("running_loss") == 2.5);
  CHECK(record.at("num_batches_remaining") == 3);
}

TEST_CASE("JSONL documents through the separately compiled reader") {
  const auto dir = fresh_dir("separate-jsonl");
  write_file(dir / "data.jsonl", "{\"text\": \"one\"}\n\n{\"instruction\": \"add\", \"output\": \"2\"}\n");
  std::vector<std::string> texts;
  mt::data::TokenStreamStats stats;
  mt::data::for_each_jsonl_document(
      dir / "data.jsonl", [&](std::string&& text, bool) { texts.push_back(text); }, stats);
  REQUIRE(texts.size() == 2);
  CHECK(texts[0] == "one");
  CHECK(texts[1] == mt::data::format_alpaca("add", "", "2"));
  CHECK(stats.skipped_lines == 1);
  write_file(dir / "bad.jsonl", "{\"messages\": 3}\n");
  const auto bad = [&] {
    mt::data::for_each_jsonl_document(
        dir / "bad.jsonl", [](std::string&&, bool) {}, stats);
  };
  CHECK(error_of_type<mt::DataError>(bad).find("bad.jsonl:1: 'messages' must be a non-empty list") !=
        std::string::npos);
}

// parallelize() on `mesh` against the plain model drawn from the same seed: equal losses, and
// every weight is this rank's (one rank: the whole weight).
template <class Mesh>
void llama_reference_check(const mt::comm::DeviceMesh<Mesh>& mesh, const mt::llama::Config& config,
                           const torch::Tensor& ids) {
  torch::manual_seed(3);
  mt::llama::LlamaForCausalLM reference(config, torch::TensorOptions().device(torch::kMeta));
  mt::llama::materialize(reference, torch::TensorOptions());
  torch::manual_seed(3);
  auto parallel =
      mt::parallelize(mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh);
  CHECK(parallel.loss(ids, ids).template item<double>() ==
        Approx(reference->loss(ids, ids).item<double>()).epsilon(1e-6));
  CHECK(parallel.local_numel() == config.num_parameters());
  CHECK(parallel.layout() == fmt::format("{}: {}", Mesh::name, decltype(parallel)::describe()));
  CHECK(parallel.data_parallel_size() == 1);
}

TEST_CASE("FSDP and DDP on one rank through the separately compiled functions") {
  mt::comm::LaunchEnv env;
  env.master_port = 0;  // the store picks a free port; nobody else needs to find it
  mt::comm::InitOptions options;
  options.env = env;
  options.timeout = std::chrono::seconds(60);
  auto mesh = mt::comm::init<mt::Mesh<mt::DP<mt::dynamic>>>(options);
  const auto& group = mesh.group<mt::DP>();

  auto config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 2;
  mt::llama::LlamaForCausalLM plain(config), sharded(config);
  torch::manual_seed(0);
  mt::llama::init_weights(plain);
  torch::manual_seed(0);
  mt::llama::init_weights(sharded);
  mt::FullyShardedDataParallel fsdp(sharded, group);
  for (auto& layer : sharded->model->decoder_layers) fsdp.fully_shard(layer);
  fsdp.fully_shard(sharded);
  mt::DistributedDataParallel ddp(plain, group);

  const auto ids = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
  auto plain_loss = ddp([&] { return plain->loss(ids, ids); });
  auto sharded_loss = sharded->loss(ids, ids);
  CHECK(sharded_loss.item<double>() == Approx(plain_loss.item<double>()).epsilon(1e-6));
  plain_loss.backward();
  sharded_loss.backward();
  const auto plain_parameters = plain->named_parameters();
  for (const auto& [name, shard] : fsdp.named_parameters()) {
    INFO(name);
    CHECK(torch::allclose(shard.grad(), plain_parameters[name].grad(), 1e-5, 1e-6));
  }
  CHECK(fsdp.named_parameters().size() == plain_parameters.size());
  CHECK_FALSE(ddp.buckets().empty());

  // parallelize() on the same one-rank mesh (no wrapper applies): ParallelLlamaRuntime builds the
  // model from the meta device with chapter 1's random numbers.
  llama_reference_check(mesh, config, ids);
}

TEST_CASE("fmt's engine compiled once formats as header-only fmt does") {
  CHECK(fmt::format("{:.3f}|{:>5}|{}|{:e}|{}", 2.5, 42, std::string_view("x"), 1e-9, true) ==
        "2.500|   42|x|1.000000e-09|true");
  CHECK(fmt::format("{:.1f} MiB", 1536.0 / 1024) == "1.5 MiB");
  CHECK_THROWS_AS(fmt::format(fmt::runtime("{:d}"), "text"), fmt::format_error);
}
