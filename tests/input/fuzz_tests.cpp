// Deterministic mutation fuzzing of the parsers that read files a user hands over: config.json,
// safetensors headers, model.safetensors.index.json and state.json. Every mutated input must
// load or give a meshtorch error (ConfigError, DataError); an exception of another type fails the
// test, a signal ends the program, and a hang runs into the test's CTest timeout (an input that
// takes over 10 s fails it too).
//   MESHTORCH_FUZZ_ITERATIONS  inputs per parser (default 100); docs/reliability.md has a longer run
//   MESHTORCH_FUZZ_SEED        seed of the mutations (default 1); the same seed gives the same inputs
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
#include "input_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;
using meshtorch::testing::fresh_dir;
using meshtorch::testing::ShardedFolder;
using meshtorch::testing::write_file;

namespace {

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const auto value = std::strtoull(text, &end, 10);
  if (*end != '\0') FAIL(name << " must be a non-negative integer, not '" << text << "'");
  return value;
}

std::uint64_t iterations() { return env_number("MESHTORCH_FUZZ_ITERATIONS", 100); }

// Values that break parsers: wrong types, signs, and the edges of 32- and 64-bit integers and doubles.
const std::vector<nlohmann::json>& odd_values() {
  static const std::vector<nlohmann::json> values = {
      nullptr,
      true,
      false,
      0,
      -1,
      1,
      3,
      std::int64_t{2147483648},
      std::int64_t{-2147483649},
      std::uint64_t{4294967296},
      std::uint64_t{9007199254740993},
      std::numeric_limits<std::int64_t>::max(),
      std::numeric_limits<std::int64_t>::min(),
      std::numeric_limits<std::uint64_t>::max(),
      0.5,
      -0.0,
      1e308,
      -1e308,
      4.9e-324,
      "",
      "x",
      "F32",
      "llama3",
      nlohmann::json::array(),
      nlohmann::json::object(),
      nlohmann::json::array({1, 2}),
      nlohmann::json::array({-1}),
      nlohmann::json::array({std::numeric_limits<std::uint64_t>::max(), std::numeric_limits<std::uint64_t>::max()}),
      nlohmann::json::array({std::uint64_t{1} << 62, 4}),
      nlohmann::json::object({{"a", 1}})};
  return values;
}

// Text spliced into an input: numbers JSON types cannot hold, deep nesting, stray syntax, bad UTF-8.
const std::vector<std::string>& odd_texts() {
  static const std::vector<std::string> texts = {"1e999",
                                                 "-1e999",
                                                 "18446744073709551616",
                                                 "-9223372036854775809",
                                                 "NaN",
                                                 "Infinity",
                                                 "-0",
                                                 "0x10",
                                                 std::string(5000, '[') + std::string(5000, ']'),
                                                 std::string(5000, '['),
                                                 "\"\\u0000\"",
                                                 "\"\\ud800\"",
                                                 "\xff\xfe",
                                                 ",",
                                                 "}",
                                                 "]",
                                                 "\"",
                                                 ":",
                                                 "null",
                                                 "{\"\":{}}"};
  return texts;
}

class Mutator {
 public:
  explicit Mutator(std::uint64_t seed) : rng_(seed) {}

  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n); }

  // One to three mutations of `document`: structural ones (a value replaced, a key removed, added
  // or repeated) on the JSON, then byte-level ones on its text. `likely` are values that mean
  // something to this parser (tensor names, shard names, dtypes), picked as often as odd ones.
  std::string mutate_json(nlohmann::json document, const std::vector<nlohmann::json>& likely) {
    const std::size_t rounds = 1 + below(3);
    const std::size_t structural = below(rounds + 1);
    std::string repeated_key;
    for (std::size_t i = 0; i < structural; ++i) mutate_structure(document, likely, repeated_key);
    std::string text = document.dump(below(2) ? -1 : 2);
    if (!repeated_key.empty()) {
      const auto at = text.find("\"" + std::string(repeat_marker) + "\"");
      if (at != std::string::npos) text.replace(at, repeat_marker.size() + 2, nlohmann::json(repeated_key).dump());
    }
    for (std::size_t i = structural; i < rounds; ++i) text = mutate_bytes(std::move(text));
    return text;
  }

  std::string mutate_bytes(std::string text) {
    const std::size_t size = text.size();
    switch (below(6)) {
      case 0:  // flip one bit
        if (size) text[below(size)] ^= static_cast<char>(1 << below(8));
        break;
      case 1:  // overwrite one byte
        if (size) text[below(size)] = static_cast<char>(below(256));
        break;
      case 2:  // truncate
        text.resize(below(size + 1));
        break;
      case 3: {  // delete a range
        const auto from = below(size + 1);
        text.erase(from, below(size - from + 1));
        break;
      }
      case 4: {  // repeat a range
        const auto from = below(size + 1);
        text.insert(below(size + 1), text.substr(from, below(size - from + 1)));
        break;
      }
      default:  // splice in an odd text
        text.insert(below(size + 1), odd_texts()[below(odd_texts().size())]);
    }
    return text;
  }

 private:
  static constexpr std::string_view repeat_marker = "@repeat-a-key-here@";

  const nlohmann::json& pick(const std::vector<nlohmann::json>& likely) {
    if (!likely.empty() && below(2)) return likely[below(likely.size())];
    return odd_values()[below(odd_values().size())];
  }

  static void collect(const nlohmann::json& value, const nlohmann::json::json_pointer& at,
                      std::vector<nlohmann::json::json_pointer>& paths) {
    paths.push_back(at);
    if (value.is_object())
      for (const auto& [key, child] : value.items()) collect(child, at / key, paths);
    if (value.is_array())
      for (std::size_t i = 0; i < value.size(); ++i) collect(value[i], at / i, paths);
  }

  void mutate_structure(nlohmann::json& document, const std::vector<nlohmann::json>& likely,
                        std::string& repeated_key) {
    std::vector<nlohmann::json::json_pointer> paths;
    collect(document, nlohmann::json::json_pointer(), paths);
    const auto path = paths[below(paths.size())];
    auto& node = document[path];
    switch (below(4)) {
      case 0:
        node = pick(likely);
        break;
      case 1:  // remove it from its parent
        if (!path.empty()) {
          auto& parent = document[path.parent_pointer()];
          if (parent.is_object()) parent.erase(path.back());
          if (parent.is_array()) parent.erase(parent.begin() + static_cast<std::ptrdiff_t>(std::stoul(path.back())));
        }
        break;
      case 2:  // add a key or an element
        if (node.is_object()) node["k" + std::to_string(below(4))] = pick(likely);
        if (node.is_array()) node.push_back(pick(likely));
        break;
      default:  // a key this object already has, a second time (its text is patched in after dumping)
        if (node.is_object() && !node.empty() && repeated_key.empty()) {
          auto key = node.begin();
          std::advance(key, static_cast<std::ptrdiff_t>(below(node.size())));
          repeated_key = key.key();
          node[std::string(repeat_marker)] = pick(likely);
        }
    }
  }

  std::mt19937_64 rng_;
};

// Runs `parse` on each input; tallies loads and named refusals, fails on anything else.
struct FuzzTally {
  std::uint64_t loaded = 0, refused = 0;
  double slowest_s = 0;

  template <class Parse>
  void run(std::uint64_t input, const std::string& excerpt, Parse&& parse) {
    INFO("input #" << input << " (MESHTORCH_FUZZ_SEED=" << env_number("MESHTORCH_FUZZ_SEED", 1)
                   << "), starting: " << excerpt.substr(0, 300));
    const auto start = std::chrono::steady_clock::now();
    try {
      parse();
      ++loaded;
    } catch (const mt::ConfigError&) {
      ++refused;
    } catch (const mt::DataError&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL_CHECK("not a meshtorch error: " << typeid(e).name() << ": " << e.what());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    slowest_s = std::max(slowest_s, seconds);
    CHECK(seconds < 10);
  }

  void report(const char* parser) const {
    INFO(parser << ": " << loaded << " inputs loaded, " << refused << " refused with a named error, slowest "
                << slowest_s << " s");
    CHECK(loaded + refused == iterations());
    // Mutations that never reach a refusal would test nothing.
    if (iterations() >= 50) CHECK(refused > 0);
  }
};

std::uint64_t seed_for(std::uint64_t parser) { return env_number("MESHTORCH_FUZZ_SEED", 1) * 1000003 + parser; }

}  // namespace

TEST_CASE("fuzzed config.json files load or give a named error", "[fuzz]") {
  const auto dir = fresh_dir("fuzz-config");
  auto config = mt::llama::presets::llama_3_1_8b;
  config.head_dim = 0;
  const auto seed = mt::llama::config_to_json(config, "bfloat16");
  const std::vector<nlohmann::json> likely = {
      "llama", "llama3", "default", "yarn", 4096, 32, 8, 128, 128256, 14336, nlohmann::json::array({128001, 128008})};
  Mutator mutator(seed_for(1));
  FuzzTally tally;
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_file(dir / "config.json", text);
    tally.run(input, text, [&] {
      // Read through io::read_json_file, the reader of every file here; load_config reads the
      // file itself and does not have its limits yet (docs/reliability.md).
      const auto path = dir / "config.json";
      const auto loaded = mt::llama::config_from_json(mt::io::read_json_file<mt::ConfigError>(path), path.string());
      // What loads is bounded: its sizes never overflow and stay under the limit.
      REQUIRE(loaded.parameter_counts());
      CHECK(loaded.num_parameters() <= mt::llama::max_parameters);
    });
  }
  tally.report("config.json");
  fs::remove_all(dir);
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
  FuzzTally tally;
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
  tally.report("safetensors");
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
  FuzzTally tally;
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
  tally.report("model.safetensors.index.json");
}

TEST_CASE("fuzzed state.json files load or give a named error", "[fuzz]") {
  const auto dir = fresh_dir("fuzz-state");
  const mt::train::RunIdentity identity{.seed = 4, .seq_length = 8, .global_batch = 2, .dataset = "d", .model = "m"};
  const nlohmann::json seed = mt::train::to_json(
      {.epoch = 1, .global_step = 20, .epoch_step = 3, .running_loss = 2.5, .running_steps = 1}, identity);
  const std::vector<nlohmann::json> likely = {4, 8, 2, "d", "m", 20, 2.5};
  Mutator mutator(seed_for(4));
  FuzzTally tally;
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_file(dir / "state.json", text);
    tally.run(input, text, [&] {
      const auto state = mt::train::read_train_state(dir, identity);
      CHECK(state.global_step >= 0);
      CHECK(state.epoch_step >= 0);
    });
  }
  tally.report("state.json");
  fs::remove_all(dir);
}
