// Fuzzing of the parsers of config.json, safetensors headers, model.safetensors.index.json and
// state.json (fuzz_support.hpp: the mutations, the limits, and the variables that set the run).
#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/io/json_file.hpp>
#include <meshtorch/meshtorch.hpp>

#include "../core/test_support.hpp"
#include "fuzz_support.hpp"
#include "input_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;
using meshtorch::testing::fresh_dir;
using meshtorch::testing::ShardedFolder;
using meshtorch::testing::write_file;

using namespace meshtorch::testing::fuzz;

TEST_CASE("fuzzed config.json files load or give a named error", "[fuzz]") {
  const auto dir = fresh_dir("fuzz-config");
  auto config = mt::llama::presets::llama_3_1_8b;
  config.head_dim = 0;
  const auto seed = mt::llama::config_to_json(config, "bfloat16");
  const std::vector<nlohmann::json> likely = {
      "llama", "llama3", "default", "yarn", 4096, 32, 8, 128, 128256, 14336, nlohmann::json::array({128001, 128008})};
  Mutator mutator(seed_for(1));
  FuzzTally tally("config.json");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_file(dir / "config.json", text);
    tally.run(input, text, [&] {
      // What a run reads a model folder's config.json with.
      const auto loaded = mt::llama::load_config(dir / "config.json");
      // What loads is bounded: its sizes never overflow and stay under the limit.
      REQUIRE(loaded.parameter_counts());
      CHECK(loaded.num_parameters() <= mt::llama::max_parameters);
    });
  }
  tally.report();
  fs::remove_all(dir);
}

// meshtorch-generate --ids: each stdin line through the bounded JSON parser, then llama::token_ids.
TEST_CASE("fuzzed --ids lines give prompt ids or a named error", "[fuzz]") {
  const auto seed = nlohmann::json::array({1, 15043, 29892, 3});
  const std::vector<nlohmann::json> likely = {-1,
                                              0,
                                              std::int64_t{9223372036854775807},
                                              1.5,
                                              1e300,
                                              "x",
                                              nullptr,
                                              nlohmann::json::array(),
                                              nlohmann::json::array({1, nlohmann::json::array({2})}),
                                              nlohmann::json::object({{"ids", 1}})};
  Mutator mutator(seed_for(22));
  FuzzTally tally("--ids line");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto line = mutator.mutate_json(seed, likely);
    tally.run(input, line, [&] {
      const auto json = mt::io::parse_json<mt::ConfigError>(line, "--ids: stdin line 1", "the line");
      for (const auto id : mt::llama::token_ids(json, "--ids: stdin line 1")) CHECK(id >= 0);
    });
  }
  tally.report();
}

TEST_CASE("fuzzed safetensors files load or give a named error", "[fuzz]") {
  const auto dir = fresh_dir("fuzz-safetensors");
  const auto path = dir / "x.safetensors";
  mt::io::save_safetensors(path,
                           {{"a", torch::randn({3, 4})},
                            {"b", torch::randn({5}).to(torch::kBFloat16)},
                            {"c", torch::arange(6, torch::kLong).view({2, 3})},
                            {"d", torch::tensor({true, false})},
                            {"e", torch::empty({0, 3})}},
                           {{"format", "pt"}});
  std::string original;
  {
    std::ifstream in(path, std::ios::binary);
    original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<unsigned char>(original[i]);
  const auto header = nlohmann::json::parse(original.substr(8, header_size));
  const std::string data = original.substr(8 + header_size);
  const std::vector<nlohmann::json> likely = {"a",
                                              "b",
                                              "F32",
                                              "BF16",
                                              "I64",
                                              "BOOL",
                                              "F16",
                                              "U8",
                                              nlohmann::json::array({0, 48}),
                                              nlohmann::json::array({3, 4}),
                                              nlohmann::json::array({48, 58}),
                                              48,
                                              58,
                                              106};
  Mutator mutator(seed_for(2));
  FuzzTally tally("safetensors");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    std::string file;
    if (mutator.below(4) == 0) {  // anywhere in the file: length, header or data
      file = mutator.mutate_bytes(original);
    } else {  // the header, re-framed with its true length, so the mutation reaches the JSON checks
      const auto text = mutator.mutate_json(header, likely);
      for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>(static_cast<std::uint64_t>(text.size()) >> (8 * i)));
      file += text + data;
    }
    write_file(path, file);
    tally.run(input, file.size() > 8 ? file.substr(8) : file, [&] {
      const auto loaded = mt::io::load_safetensors(path);
      // Nothing larger than the file is ever allocated.
      for (const auto& [name, tensor] : loaded.tensors) CHECK(tensor.nbytes() <= file.size());
    });
  }
  tally.report();
  fs::remove_all(dir);
}

TEST_CASE("fuzzed model.safetensors.index.json files load in-folder weights or give a named error", "[fuzz]") {
  ShardedFolder folder("fuzz-index");
  // Bait outside the folder, holding 7.0 everywhere: no input may make any of it load.
  auto bait = folder.shard_contents(0);
  for (auto& [name, tensor] : bait) tensor = torch::full_like(tensor, 7.0);
  mt::io::save_safetensors(folder.root / "outside.safetensors", bait);
  fs::create_symlink(folder.root / "outside.safetensors", folder.dir / "link-out.safetensors");
  fs::create_symlink(folder.shard_names[1], folder.dir / "link-in.safetensors");
  fs::create_directory(folder.dir / "dir.safetensors");
  REQUIRE(::mkfifo((folder.dir / "fifo.safetensors").c_str(), 0600) == 0);  // opening it would block
  const std::vector<nlohmann::json> likely = {folder.shard_names[0],
                                              folder.shard_names[1],
                                              folder.shard_tensors[0].front(),
                                              "../outside.safetensors",
                                              (folder.root / "outside.safetensors").string(),
                                              "link-out.safetensors",
                                              "link-in.safetensors",
                                              "dir.safetensors",
                                              "fifo.safetensors",
                                              "missing.safetensors",
                                              "/etc/passwd",
                                              ".",
                                              "..",
                                              std::string("model-00001-of-00002.safetensors\0x", 34)};
  const auto seed = folder.index_json();
  Mutator mutator(seed_for(3));
  FuzzTally tally("model.safetensors.index.json");
  const auto holds_bait = [&] {
    for (const auto& item : folder.loaded->named_parameters())
      if (torch::equal(item.value(), torch::full_like(item.value(), 7.0))) return true;
    return false;
  };
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_file(folder.dir / "model.safetensors.index.json", text);
    {
      torch::NoGradGuard no_grad;
      for (auto& item : folder.loaded->named_parameters()) item.value().zero_();
    }
    tally.run(input, text, [&] {
      folder.load();
      folder.check_weights_equal();
    });
    CHECK_FALSE(holds_bait());
  }
  tally.report();
}

TEST_CASE("fuzzed state.json files load or give a named error", "[fuzz]") {
  const auto dir = fresh_dir("fuzz-state");
  const mt::train::RunIdentity identity{.seed = 4, .seq_length = 8, .global_batch = 2, .dataset = "d", .model = "m"};
  const nlohmann::json seed = mt::train::to_json(
      {.epoch = 1, .global_step = 20, .epoch_step = 3, .running_loss = 2.5, .running_steps = 1}, identity);
  const std::vector<nlohmann::json> likely = {4, 8, 2, "d", "m", 20, 2.5};
  Mutator mutator(seed_for(4));
  FuzzTally tally("state.json");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_file(dir / "state.json", text);
    tally.run(input, text, [&] {
      const auto state = mt::train::read_train_state(dir, identity);
      CHECK(state.global_step >= 0);
      CHECK(state.epoch_step >= 0);
    });
  }
  tally.report();
  fs::remove_all(dir);
}
