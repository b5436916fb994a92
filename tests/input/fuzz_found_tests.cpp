// Inputs the fuzz tests (fuzz_tests.cpp, file_fuzz_tests.cpp) found that ended in something other
// than a named error, each kept as a regression test after its fix.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/data/bpe_tokenizer.hpp>
#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/data/documents.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/train/rng.hpp>

#include "../core/test_support.hpp"

namespace fuzz_found {

namespace mt = meshtorch;
namespace fs = std::filesystem;

// The message of what reading `line` as a JSONL data file throws, or "no error".
std::string jsonl_error(const std::string& line) {
  const auto dir = mt::testing::fresh_dir("fuzz-found-jsonl");
  const auto path = dir / "data.jsonl";
  std::ofstream(path) << line << "\n";
  mt::data::TokenStreamStats stats;
  try {
    mt::data::for_each_jsonl_document(
        path, [](std::string&&, bool) {}, stats);
  } catch (const mt::DataError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace fuzz_found

using namespace fuzz_found;

TEST_CASE("a JSONL data line goes through the bounded JSON reader: depth, repeated keys and 1e999 are named",
          "[fuzz-found]") {
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  CHECK_THAT(jsonl_error(R"({"text": 1e999})"), Catch::Contains("data.jsonl:1: not valid JSON"));
  CHECK_THAT(jsonl_error(R"({"text": "a", "text": "b"})"),
             Catch::Contains("data.jsonl:1: the line names 'text' twice"));
  CHECK_THAT(jsonl_error(R"({"messages": )" + deep + "}"),
             Catch::Contains("data.jsonl:1: nested deeper than 64 levels"));
  CHECK(jsonl_error(R"({"text": "fine"})") == "no error");
}

namespace fuzz_found {

// A JSONL data set of a few documents, read with the byte tokenizer through its token cache:
// the cache file and the expected number of ids.
struct CachedCorpus {
  fs::path root = mt::testing::fresh_dir("fuzz-found-cache");
  fs::path data = root / "corpus.jsonl", cache_file;
  std::int64_t blocks = 0;

  CachedCorpus() {
    std::ofstream(data) << R"({"text": "one document of some length"})"
                        << "\n"
                        << R"({"text": "and another, a little longer than the first"})"
                        << "\n";
    ::setenv("MESHTORCH_DATA_CACHE", (root / "cache").c_str(), 1);
    blocks = load().size();
    for (const auto& entry : fs::directory_iterator(root / "cache")) cache_file = entry.path();
    REQUIRE(!cache_file.empty());
  }
  ~CachedCorpus() { ::unsetenv("MESHTORCH_DATA_CACHE"); }

  mt::data::TokenBlocks load() const { return mt::data::load_dataset(data.string(), 4, (root / "no-model").string()); }

  // Writes `value` (`width` bytes, little-endian) at `offset` of the cache file; negative: from its end.
  void patch(std::int64_t offset, std::uint64_t value, int width) const {
    std::fstream file(cache_file, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(offset < 0 ? static_cast<std::streamoff>(fs::file_size(cache_file)) + offset : offset);
    for (int b = 0; b < width; ++b) file.put(static_cast<char>(value >> (8 * b)));
  }
};

}  // namespace fuzz_found

TEST_CASE("a token cache whose footer's count wraps the size check is rebuilt, not mapped as 2^63 ids",
          "[fuzz-found]") {
  const CachedCorpus corpus;
  // The footer's token_count (16 bytes into the 64-byte footer) + 2^63: times 2 bytes per id, it wrapped to the
  // file's true size.
  std::uint64_t count = 0;
  {
    std::ifstream file(corpus.cache_file, std::ios::binary);
    file.seekg(static_cast<std::streamoff>(fs::file_size(corpus.cache_file)) - 64 + 16);
    file.read(reinterpret_cast<char*>(&count), 8);
  }
  REQUIRE(count > 0);
  corpus.patch(-64 + 16, count + (std::uint64_t{1} << 63), 8);
  const auto blocks = corpus.load();
  CHECK(blocks.size() == corpus.blocks);
}

TEST_CASE("a token cache id outside the range its footer records is a named error, not an id past the vocabulary",
          "[fuzz-found]") {
  const CachedCorpus corpus;
  corpus.patch(0, 0xffff, 2);  // the first id (the byte tokenizer's ids fit 16 bits)
  const auto blocks = corpus.load();
  blocks.check_vocab(258);  // from the footer's range, which the damage did not change
  CHECK_THROWS_WITH(blocks.gather({0}), Catch::Contains("block 0 holds the id 65535, outside the range") &&
                                            Catch::Contains("its token cache records"));
  CHECK_NOTHROW(blocks.gather({blocks.size() - 1}));
}

TEST_CASE("tokenizer.json fields of the wrong type are named, not nlohmann's type_error", "[fuzz-found]") {
  const auto original =
      nlohmann::json::parse(std::ifstream(fs::path(MESHTORCH_DATA_FIXTURES) / "bpe" / "tokenizer.json"));
  auto error_with = [&](const std::string& pointer, const nlohmann::json& value) {
    auto j = original;
    j[nlohmann::json::json_pointer(pointer)] = value;
    try {
      mt::data::BpeTokenizer(j, "tokenizer.json");
    } catch (const mt::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error_with("/model", 3), Catch::Contains("'model' must be an object, got 3"));
  CHECK_THAT(error_with("/model/type", 3), Catch::Contains("'model.type' must be a string, got 3"));
  CHECK_THAT(error_with("/model/unk_token", 3), Catch::Contains("'model.unk_token' must be a string, got 3"));
  CHECK_THAT(error_with("/pre_tokenizer", 3), Catch::Contains("'pre_tokenizer' must be an object, got 3"));
  CHECK_THAT(error_with("/pre_tokenizer/type", 3), Catch::Contains("'pre_tokenizer.type' must be a string, got 3"));
  CHECK_THAT(error_with("/pre_tokenizer/pretokenizers", 3),
             Catch::Contains("'pre_tokenizer.pretokenizers' must be a list"));
  CHECK_THAT(error_with("/pre_tokenizer/pretokenizers/0", 3),
             Catch::Contains("'pre_tokenizer.pretokenizers[0]' must be an object, got 3"));
  CHECK_THAT(error_with("/pre_tokenizer/pretokenizers/0/pattern/Regex", 3),
             Catch::Contains("'pre_tokenizer.pretokenizers[0].pattern.Regex' must be a string, got 3"));
  CHECK_THAT(error_with("/decoder", 3), Catch::Contains("'decoder' is 3"));
  CHECK_THAT(error_with("/decoder/type", 3), Catch::Contains("'decoder.type' must be a string, got 3"));
  CHECK_THAT(error_with("/added_tokens/0", 3), Catch::Contains("'added_tokens[0]' must be an object, got 3"));
  CHECK_THAT(error_with("/added_tokens/0/content", 3),
             Catch::Contains("'added_tokens[0].content' must be a string, got 3"));
  CHECK(error_with("/model/unk_token", nullptr) == "no error");
}

TEST_CASE("a checkpoint's RNG state that LibTorch refuses is a named error, not c10::Error", "[fuzz-found]") {
  const auto saved = mt::train::capture_rng_states();
  const mt::io::SafetensorsFile damaged{{{"rng.cpu", torch::zeros({16}, torch::kByte)}}, {}};
  CHECK_THROWS_WITH(mt::train::restore_rng_states(damaged, "ckpt/rank0.safetensors"),
                    Catch::Contains("ckpt/rank0.safetensors: 'rng.cpu' is not a random-number generator state "
                                    "LibTorch accepts"));
  const mt::io::SafetensorsFile good{saved, {}};
  CHECK_NOTHROW(mt::train::restore_rng_states(good, "ckpt/rank0.safetensors"));
}
