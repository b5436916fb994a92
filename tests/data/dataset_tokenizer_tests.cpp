// Data sets read with a model folder's tokenizer: -d text/JSONL with -m a folder holding a
// tokenizer uses it; builtin, .bin files and folders without a tokenizer keep the byte tokenizer.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/models/llama/weights.hpp>

namespace mt = meshtorch;
namespace fs = std::filesystem;

namespace {

const fs::path fixtures = MESHTORCH_DATA_FIXTURES;

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("meshtorch-data-test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<std::int32_t> all_tokens(const mt::data::TokenBlocks& blocks) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(blocks.size()));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<std::int64_t>(i);
  const auto t = blocks.gather(rows).flatten();
  return {t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel()};
}

}  // namespace

TEST_CASE("a JSONL data set with a model folder is tokenised by the folder's tokenizer", "[dataset]") {
  const auto dir = fresh_dir("dataset");
  const auto model = dir / "model";
  fs::create_directories(model);
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", model / "tokenizer.json");
  fs::copy_file(fixtures / "bpe" / "tokenizer_config.json", model / "tokenizer_config.json");
  const auto data = dir / "train.jsonl";
  {
    std::ofstream out(data);
    for (int i = 0; i < 40; ++i)
      out << nlohmann::json({{"text", "document " + std::to_string(i) + ": the quick brown fox, café 数据 🙂"}}).dump() << "\n";
  }
  std::string note;
  const auto tokenizer = mt::data::tokenizer_for_dataset(data.string(), model.string(), &note);
  REQUIRE(tokenizer);
  CHECK_THAT(note, Catch::Contains("byte-level BPE"));

  const auto blocks = mt::data::load_dataset(data.string(), 16, model.string());
  const auto documents = mt::data::read_jsonl_documents(data);
  auto want = tokenizer->encode_documents(documents, 1);
  want.resize(want.size() / 16 * 16);  // packing drops the remainder
  CHECK(all_tokens(blocks) == want);
  CHECK(want.front() == 0);  // <|begin_of_text|>
  blocks.check_vocab(tokenizer->vocab_size());

  // A folder without a tokenizer, `builtin`, or a preset: the byte tokenizer, as before.
  CHECK_FALSE(mt::data::tokenizer_for_dataset(data.string(), (dir / "nothing").string()));
  CHECK_FALSE(mt::data::tokenizer_for_dataset("builtin", model.string()));
  CHECK_FALSE(mt::data::tokenizer_for_dataset(data.string(), "llama-tiny"));
  CHECK(all_tokens(mt::data::load_dataset(data.string(), 16, "llama-tiny")) ==
        all_tokens(mt::data::load_dataset(data.string(), 16)));
  fs::remove_all(dir);
}

TEST_CASE("a text data set with a SentencePiece folder is tokenised with its <s> and </s>", "[dataset]") {
  const auto dir = fresh_dir("dataset-sp");
  const auto model = dir / "model";
  fs::create_directories(model);
  fs::copy_file(fixtures / "sentencepiece" / "tokenizer.model", model / "tokenizer.model");
  const auto data = dir / "train.txt";
  std::ofstream(data) << "first document\nstill the first\n\nsecond document 数据 🙂\n";
  const auto blocks = mt::data::load_dataset(data.string(), 4, model.string());
  const mt::data::SentencePieceTokenizer tokenizer(model / "tokenizer.model");
  std::vector<std::int32_t> want = {1};
  for (auto id : tokenizer.encode("first document\nstill the first")) want.push_back(id);
  want.insert(want.end(), {2, 1});
  for (auto id : tokenizer.encode("second document 数据 🙂")) want.push_back(id);
  want.push_back(2);
  want.resize(want.size() / 4 * 4);
  CHECK(all_tokens(blocks) == want);
  fs::remove_all(dir);
}

TEST_CASE("the dtype of a folder's config.json is what --dtype auto loads", "[dataset][config]") {
  const auto dir = fresh_dir("dtype");
  auto j = mt::llama::config_to_json(mt::llama::presets::llama_tiny, "bfloat16");
  std::ofstream(dir / "config.json") << j.dump();
  CHECK(mt::llama::pretrained_dtype(dir) == torch::kBFloat16);
  j.erase("dtype");
  j["torch_dtype"] = "float16";
  std::ofstream(dir / "config.json") << j.dump();
  CHECK(mt::llama::pretrained_dtype(dir) == torch::kHalf);
  j.erase("torch_dtype");
  std::ofstream(dir / "config.json") << j.dump();
  CHECK_FALSE(mt::llama::pretrained_dtype(dir).has_value());
  CHECK_FALSE(mt::llama::pretrained_dtype("llama-tiny").has_value());
  fs::remove_all(dir);
}
