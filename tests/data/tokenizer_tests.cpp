// Tokenizers of model folders against the checked-in fixture: ids equal to those of the
// `tokenizers` and `sentencepiece` packages on a varied corpus, decode(encode(x)) == x, batch
// encoding on several threads, the folder chooser, and errors naming the field at fault.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/data/byte_level.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>

#include "data_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;

namespace {

using mt::testing::error_of;
using mt::testing::fixtures;
using mt::testing::fresh_dir;

std::vector<nlohmann::json> read_jsonl(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE(in);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

std::vector<std::string> corpus() {
  std::vector<std::string> texts;
  for (const auto& row : read_jsonl(fixtures / "corpus.jsonl")) texts.push_back(row.get<std::string>());
  return texts;
}

void write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

nlohmann::json fixture_tokenizer_json() {
  std::ifstream in(fixtures / "bpe" / "tokenizer.json");
  return nlohmann::json::parse(in);
}

// Each text's ids must equal the reference's; the first difference is shown with its text.
void check_ids_equal_reference(const mt::data::TextTokenizer& tokenizer, const fs::path& expected) {
  const auto texts = corpus();
  const auto want = read_jsonl(expected);
  REQUIRE(want.size() == texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    INFO("corpus line " << i + 1 << ": " << nlohmann::json(texts[i]).dump());
    const auto ids = tokenizer.encode(texts[i]);
    CHECK(nlohmann::json(ids) == want[i]);
  }
}

}  // namespace

TEST_CASE("byte-level BPE with Llama 3's pre-tokenizer gives the tokenizers package's ids", "[tokenizer]") {
  const auto tokenizer = mt::data::BpeTokenizer::from_file(fixtures / "bpe" / "tokenizer.json");
  check_ids_equal_reference(tokenizer, fixtures / "bpe" / "expected.jsonl");
  CHECK(tokenizer.vocab_size() == 602);  // 600 trained (3 special among them), <mask>, NOTE:
}

TEST_CASE("byte-level BPE decodes its ids back to the text", "[tokenizer]") {
  const auto tokenizer = mt::data::BpeTokenizer::from_file(fixtures / "bpe" / "tokenizer.json");
  for (const auto& text : corpus()) {
    INFO(nlohmann::json(text).dump());
    const auto ids = tokenizer.encode(text);
    if (text.find("<mask>") == std::string::npos) {
      CHECK(tokenizer.decode(ids) == text);
    } else {
      // <mask> is an added token with lstrip: it takes the spaces before it, as in HF.
      auto stripped = text;
      stripped.replace(stripped.find("   <mask>"), 9, "<mask>");
      CHECK(tokenizer.decode(ids) == stripped);
    }
  }
  CHECK_THAT(error_of([&] {
               tokenizer.decode(std::vector<std::int32_t>{5, 9999});
             }),
             Catch::Contains("token id 9999 is not in the vocabulary"));
}

TEST_CASE("decoded bytes become valid UTF-8 as transformers' decode makes them, held back while cut short",
          "[tokenizer]") {
  const auto lossy = [](std::string_view bytes, bool last) {
    std::string out;
    const auto consumed = mt::data::byte_level::append_utf8_lossy(bytes, out, last);
    return std::pair(out, consumed);
  };
  const std::string fffd = "\xEF\xBF\xBD";
  // Expected values: Python's bytes.decode("utf-8", "replace"), which follows the same rule.
  CHECK(lossy("a\xC3\xA9"
              "b",
              true) == std::pair(std::string("a\xC3\xA9"
                                             "b"),
                                 std::size_t{4}));
  CHECK(lossy("\xF0\x9F\x98\x80", true).first == "\xF0\x9F\x98\x80");
  CHECK(lossy("\xFF!", true).first == fffd + "!");
  CHECK(lossy("\xE2\x82x", true).first == fffd + "x");             // one maximal subpart
  CHECK(lossy("\xED\xA0\x80", true).first == fffd + fffd + fffd);  // a surrogate: three
  CHECK(lossy("\xC0\xAF", true).first == fffd + fffd);             // overlong
  // Cut short by the end: left for the next bytes, unless this is the last of them.
  CHECK(lossy("ok\xE2\x82", false) == std::pair(std::string("ok"), std::size_t{2}));
  CHECK(lossy("ok\xE2\x82", true) == std::pair("ok" + fffd, std::size_t{4}));
}

TEST_CASE("a prompt gets the special tokens of tokenizer.json's post-processor, as transformers' encode adds them",
          "[tokenizer]") {
  std::ifstream in(fixtures / "bpe" / "tokenizer.json");
  auto json = nlohmann::json::parse(in);
  const mt::data::BpeTokenizer plain(json, "fixture");
  CHECK(plain.encode_with_special_tokens("Hello") == plain.encode("Hello"));  // no post_processor: nothing
  // Llama 3's: a Sequence of ByteLevel and a template putting <|begin_of_text|> (id 0) first.
  json["post_processor"] = nlohmann::json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [0], "tokens": ["<|begin_of_text|>"]},
                          "<|end_of_text|>": {"id": "<|end_of_text|>", "ids": [1], "tokens": ["<|end_of_text|>"]}}}]})");
  const mt::data::BpeTokenizer templated(json, "fixture");
  auto expected = plain.encode("Hello");
  expected.insert(expected.begin(), 0);
  expected.push_back(1);
  CHECK(templated.encode_with_special_tokens("Hello") == expected);
  json["post_processor"] =
      nlohmann::json::parse(R"({"type": "BertProcessing", "sep": ["[SEP]", 1], "cls": ["[CLS]", 0]})");
  CHECK_THAT(error_of([&] { mt::data::BpeTokenizer bert(json, "fixture"); }),
             Catch::Contains("post_processor.type") && Catch::Contains("'BertProcessing'"));
}

TEST_CASE("special tokens written in the text are single ids", "[tokenizer]") {
  const auto tokenizer = mt::data::BpeTokenizer::from_file(fixtures / "bpe" / "tokenizer.json");
  const auto bos = tokenizer.token_to_id("<|begin_of_text|>").value();
  const auto eot = tokenizer.token_to_id("<|eot_id|>").value();
  const auto ids = tokenizer.encode("<|begin_of_text|>hi<|eot_id|>");
  REQUIRE(ids.size() >= 3);
  CHECK(ids.front() == bos);
  CHECK(ids.back() == eot);
  // An unfinished special token is plain text.
  const auto partial = tokenizer.encode("<|begin_of_text");
  CHECK(std::find(partial.begin(), partial.end(), bos) == partial.end());
}

TEST_CASE("special tokens are split off before normalized added tokens, as HF does", "[tokenizer]") {
  // With a special token "TE:", HF finds it inside "NOTE:" before looking for the added token
  // "NOTE:" (ids from the tokenizers package on the same file).
  auto j = fixture_tokenizer_json();
  j["added_tokens"].push_back({{"id", 602},
                               {"content", "TE:"},
                               {"single_word", false},
                               {"lstrip", false},
                               {"rstrip", false},
                               {"normalized", false},
                               {"special", true}});
  const mt::data::BpeTokenizer tokenizer(j, "tokenizer.json");
  CHECK(tokenizer.encode("a NOTE: b") == std::vector<std::int32_t>{67, 223, 48, 49, 602, 317});
  const auto plain = mt::data::BpeTokenizer::from_file(fixtures / "bpe" / "tokenizer.json");
  CHECK(plain.encode("a NOTE: b") == std::vector<std::int32_t>{67, 223, 601, 317});
}

TEST_CASE("SentencePiece tokenizer.model gives the sentencepiece package's ids and decodes back", "[tokenizer]") {
  const mt::data::SentencePieceTokenizer tokenizer(fixtures / "sentencepiece" / "tokenizer.model");
  check_ids_equal_reference(tokenizer, fixtures / "sentencepiece" / "expected.jsonl");
  for (const auto& text : corpus()) {
    INFO(nlohmann::json(text).dump());
    CHECK(tokenizer.decode(tokenizer.encode(text)) == text);
  }
  CHECK(tokenizer.bos_id == 1);
  CHECK(tokenizer.eos_id == 2);
  CHECK(tokenizer.vocab_size() == 600);
}

TEST_CASE("batch encoding on several threads equals encoding one text at a time", "[tokenizer]") {
  const auto tokenizer = mt::data::BpeTokenizer::from_file(fixtures / "bpe" / "tokenizer.json");
  std::vector<std::string> texts;
  for (int repeat = 0; repeat < 5; ++repeat)
    for (const auto& text : corpus()) texts.push_back(text);
  std::vector<std::vector<std::int32_t>> one_by_one;
  for (const auto& text : texts) one_by_one.push_back(tokenizer.encode(text));
  for (unsigned threads : {1u, 2u, 3u}) {
    INFO(threads << " threads");
    CHECK(tokenizer.encode_batch(texts, threads) == one_by_one);
  }
  // Documents: each as <bos> ids <eos>, concatenated in order.
  mt::data::BpeTokenizer with_bounds = tokenizer;
  with_bounds.bos_id = 0;
  with_bounds.eos_id = 1;
  const std::vector<std::string> documents = {"one", "two three"};
  std::vector<std::int32_t> want = {0};
  for (auto id : tokenizer.encode("one")) want.push_back(id);
  want.insert(want.end(), {1, 0});
  for (auto id : tokenizer.encode("two three")) want.push_back(id);
  want.push_back(1);
  CHECK(with_bounds.encode_documents(documents, 2) == want);
  CHECK_THAT(error_of([&] { tokenizer.encode_documents(documents, 1); }), Catch::Contains("no end-of-text token"));
}

TEST_CASE("text that is not UTF-8 is an error naming the tokenizer", "[tokenizer]") {
  const auto tokenizer = mt::data::BpeTokenizer::from_file(fixtures / "bpe" / "tokenizer.json");
  CHECK_THAT(error_of([&] { tokenizer.encode("caf\xe9 latin-1"); }),
             Catch::Contains("tokenizer.json") && Catch::Contains("valid UTF-8"));
}

TEST_CASE("tokenizer.json settings that would change the ids are refused by name", "[tokenizer]") {
  auto error_with = [](const std::function<void(nlohmann::json&)>& edit) {
    auto j = fixture_tokenizer_json();
    edit(j);
    return error_of([&] { mt::data::BpeTokenizer(j, "tokenizer.json"); });
  };
  CHECK(error_with([](nlohmann::json&) {}) == "no error");
  CHECK_THAT(error_with([](nlohmann::json& j) {
               j["normalizer"] = {{"type", "NFC"}};
             }),
             Catch::Contains("field 'normalizer' is 'NFC'"));
  CHECK_THAT(error_with([](nlohmann::json& j) { j["model"]["byte_fallback"] = true; }),
             Catch::Contains("'model.byte_fallback'"));
  CHECK_THAT(error_with([](nlohmann::json& j) { j["model"]["dropout"] = 0.1; }), Catch::Contains("'model.dropout'"));
  CHECK_THAT(error_with([](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }), Catch::Contains("'model.type'"));
  CHECK_THAT(error_with([](nlohmann::json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }),
             Catch::Contains("'model.end_of_word_suffix'"));
  CHECK_THAT(error_with([](nlohmann::json& j) { j["added_tokens"][0]["single_word"] = true; }),
             Catch::Contains("'added_tokens[0].single_word'"));
  CHECK_THAT(error_with([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
             Catch::Contains("'pre_tokenizer.pretokenizers[0].behavior'"));
  CHECK_THAT(error_with([](nlohmann::json& j) {
               j["pre_tokenizer"] = {{"type", "Whitespace"}};
             }),
             Catch::Contains("'pre_tokenizer.type' is 'Whitespace'"));
  CHECK_THAT(
      error_with([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
      Catch::Contains("'pre_tokenizer.pretokenizers[0].pattern'") && Catch::Contains("does not compile"));
  CHECK_THAT(error_with([](nlohmann::json& j) {
               j["decoder"] = {{"type", "Metaspace"}};
             }),
             Catch::Contains("'decoder' is 'Metaspace'"));
  CHECK_THAT(error_with([](nlohmann::json& j) {
               j["model"]["merges"][3] = {"nosuchtoken", "x"};
             }),
             Catch::Contains("'model.merges[3]'"));
}

TEST_CASE("GPT-2 style ByteLevel with its own regex and a prefix space", "[tokenizer]") {
  auto j = fixture_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  const mt::data::BpeTokenizer tokenizer(j, "gpt2-style tokenizer.json");
  // The prefix space makes "hello" encode as " hello" does, and decoding shows it.
  CHECK(tokenizer.encode("hello world") == tokenizer.encode(" hello world"));
  CHECK(tokenizer.decode(tokenizer.encode("hello world")) == " hello world");
}

TEST_CASE("a model folder's tokenizer files are read only inside it", "[tokenizer]") {
  const auto dir = fresh_dir("tokenizer-links");
  const auto outside = fresh_dir("tokenizer-links-outside");
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", outside / "tokenizer.json");
  // A tokenizer.json linked from elsewhere is refused before it is read.
  fs::create_symlink(outside / "tokenizer.json", dir / "tokenizer.json");
  CHECK(mt::data::folder_has_tokenizer(dir));
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("the tokenizer file is 'tokenizer.json', a link to") &&
                 Catch::Contains("outside the model folder"));
  // So is a tokenizer_config.json leading out, and a link that leads nowhere is an error, not
  // a folder without a tokenizer (which would silently train on bytes).
  fs::remove(dir / "tokenizer.json");
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", dir / "tokenizer.json");
  write(outside / "tokenizer_config.json", R"({"eos_token": "<|eot_id|>"})");
  fs::create_symlink(outside / "tokenizer_config.json", dir / "tokenizer_config.json");
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("'tokenizer_config.json', a link to") && Catch::Contains("outside the model folder"));
  fs::remove(dir / "tokenizer_config.json");
  fs::remove(dir / "tokenizer.json");
  fs::create_symlink(dir / "gone.json", dir / "tokenizer.json");
  CHECK(mt::data::folder_has_tokenizer(dir));
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("'tokenizer.json', a link that leads nowhere"));
  // A repeated key in tokenizer_config.json is refused by name (nlohmann alone keeps the last).
  fs::remove(dir / "tokenizer.json");
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", dir / "tokenizer.json");
  write(dir / "tokenizer_config.json", R"({"eos_token": "<|eot_id|>", "eos_token": "<|begin_of_text|>"})");
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("tokenizer_config.json") && Catch::Contains("eos_token"));
  fs::remove_all(dir);
  fs::remove_all(outside);
}

TEST_CASE("the folder's files choose the tokenizer and its bos/eos", "[tokenizer]") {
  const auto dir = fresh_dir("chooser");
  CHECK_FALSE(mt::data::folder_has_tokenizer(dir));
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("holds no tokenizer.json or tokenizer.model"));

  // tokenizer.json with tokenizer_config.json naming bos/eos.
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", dir / "tokenizer.json");
  fs::copy_file(fixtures / "bpe" / "tokenizer_config.json", dir / "tokenizer_config.json");
  std::string note;
  auto tokenizer = mt::data::load_tokenizer(dir, &note);
  CHECK(dynamic_cast<mt::data::BpeTokenizer*>(tokenizer.get()));
  CHECK(tokenizer->bos_id == 0);
  CHECK(tokenizer->eos_id == 1);
  CHECK_THAT(
      note, Catch::Contains("bos 0 from tokenizer_config.json") && Catch::Contains("eos 1 from tokenizer_config.json"));

  // generation_config.json alone (eos as a list, the first is used); tokenizer_config.json wins over it.
  write(dir / "generation_config.json", R"({"bos_token_id": 2, "eos_token_id": [2, 1]})");
  fs::remove(dir / "tokenizer_config.json");
  tokenizer = mt::data::load_tokenizer(dir);
  CHECK(tokenizer->bos_id == 2);
  CHECK(tokenizer->eos_id == 2);
  write(dir / "tokenizer_config.json", R"({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"})");
  tokenizer = mt::data::load_tokenizer(dir);
  CHECK(tokenizer->bos_id == 0);
  CHECK(tokenizer->eos_id == 2);
  write(dir / "tokenizer_config.json", R"({"eos_token": "<|no_such_token|>"})");
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("tokenizer_config.json: field 'eos_token'") && Catch::Contains("<|no_such_token|>"));
  write(dir / "tokenizer_config.json", R"({"eos_token": "<|eot_id|>", "add_bos_token": false})");
  CHECK_FALSE(mt::data::load_tokenizer(dir)->bos_id.has_value());
  write(dir / "generation_config.json", R"({"eos_token_id": 70000})");
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }),
             Catch::Contains("generation_config.json: field 'eos_token_id'"));
  fs::remove(dir / "generation_config.json");

  // A tokenizer.json that is not byte-level BPE beside a tokenizer.model: the SentencePiece model.
  auto j = fixture_tokenizer_json();
  j["model"]["byte_fallback"] = true;
  write(dir / "tokenizer.json", j.dump());
  CHECK_THAT(error_of([&] { mt::data::load_tokenizer(dir); }), Catch::Contains("model.byte_fallback"));
  fs::copy_file(fixtures / "sentencepiece" / "tokenizer.model", dir / "tokenizer.model");
  fs::remove(dir / "tokenizer_config.json");
  tokenizer = mt::data::load_tokenizer(dir, &note);
  CHECK(dynamic_cast<mt::data::SentencePieceTokenizer*>(tokenizer.get()));
  CHECK_THAT(note, Catch::Contains("using tokenizer.model instead"));
  CHECK(tokenizer->bos_id == 1);
  CHECK(tokenizer->eos_id == 2);
  fs::remove_all(dir);
}
