// Data sets read with a model folder's tokenizer: -d text/JSONL with -m a folder holding a
// tokenizer uses it; builtin, .bin files and folders without a tokenizer keep the byte tokenizer.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include <meshtorch/data/data_files.hpp>
#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/train/device.hpp>

#include "data_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;

namespace {

using mt::testing::error_of;
using mt::testing::fixtures;
using mt::testing::fresh_dir;

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
  std::vector<std::string> texts;
  {
    std::ofstream out(data);
    for (int i = 0; i < 40; ++i) {
      texts.push_back("document " + std::to_string(i) + ": the quick brown fox, café 数据 🙂");
      out << nlohmann::json({{"text", texts.back()}}).dump() << "\n";
    }
  }
  std::string note;
  const auto blocks = mt::data::load_dataset(data.string(), 16, model.string(), &note);
  CHECK_THAT(note, Catch::Contains("byte-level BPE") && Catch::Contains("40 document(s)"));
  const auto tokenizer = mt::data::load_tokenizer(model);
  auto want = tokenizer->encode_documents(texts, 1);
  want.resize(want.size() / 16 * 16);  // packing drops the remainder
  CHECK(all_tokens(blocks) == want);
  CHECK(want.front() == 0);  // <|begin_of_text|>
  blocks.check_vocab(tokenizer->vocab_size());

  // A folder without a tokenizer, or a preset: the byte tokenizer, as `builtin` has.
  std::string byte_note;
  const auto bytes = all_tokens(mt::data::load_dataset(data.string(), 16, (dir / "nothing").string(), &byte_note));
  CHECK_THAT(byte_note, Catch::StartsWith("byte tokenizer"));
  CHECK(all_tokens(mt::data::load_dataset(data.string(), 16, "llama-tiny")) == bytes);
  CHECK(all_tokens(mt::data::load_dataset(data.string(), 16)) == bytes);
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

TEST_CASE("the dtype of a folder's pretrained weights is what --dtype auto trains in", "[dataset][config]") {
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

  // --dtype auto takes the dtype of pretrained weights (a config-only folder is a model from
  // scratch: the device's default); explicit flags win; float16 is refused with the fix.
  j["dtype"] = "bfloat16";
  std::ofstream(dir / "config.json") << j.dump();
  CHECK_FALSE(mt::llama::weights_dtype(dir).has_value());
  CHECK(mt::train::resolve_dtype("auto", torch::kCPU, mt::llama::weights_dtype(dir)) == torch::kFloat);
  mt::io::save_safetensors(dir / "model.safetensors", {{"x", torch::zeros({2}, torch::kBFloat16)}});
  CHECK(mt::llama::weights_dtype(dir) == torch::kBFloat16);
  CHECK(mt::train::resolve_dtype("auto", torch::kCPU, mt::llama::weights_dtype(dir)) == torch::kBFloat16);
  CHECK(mt::train::resolve_dtype("float32", torch::kCPU, mt::llama::weights_dtype(dir)) == torch::kFloat);
  CHECK_THAT(error_of([] { mt::train::resolve_dtype("auto", torch::kCPU, torch::kHalf); }),
             Catch::Contains("float16") && Catch::Contains("--dtype bfloat16 or --dtype float32"));
  fs::remove_all(dir);
}

TEST_CASE("a data set is a file or a folder (with --dataset-subset) or a pattern and other files are listed",
          "[dataset][files]") {
  const auto dir = fresh_dir("files");
  fs::create_directories(dir / "set" / "train" / "nested");
  fs::create_directories(dir / "set" / "valid");
  fs::create_directories(dir / "set" / "train" / ".meshtorch-cache");
  std::ofstream(dir / "set" / "train" / "b.jsonl") << R"({"text": "b"})"
                                                   << "\n";
  std::ofstream(dir / "set" / "train" / "nested" / "a.txt") << "a\n";
  std::ofstream(dir / "set" / "train" / "README.md") << "not data\n";
  std::ofstream(dir / "set" / "train" / ".hidden.txt") << "hidden\n";
  std::ofstream(dir / "set" / "train" / ".meshtorch-cache" / "x.txt") << "a cache's own\n";

  const auto train = mt::data::resolve_data_files((dir / "set").string(), "train");
  REQUIRE(train.files.size() == 2);
  CHECK(train.files[0].filename() == "b.jsonl");  // path order: "b.jsonl" < "nested/a.txt"
  CHECK(train.files[1].filename() == "a.txt");
  REQUIRE(train.ignored.size() == 1);
  CHECK(train.ignored[0].filename() == "README.md");
  CHECK(train.root == dir / "set" / "train");

  const auto pattern = mt::data::resolve_data_files((dir / "set" / "train" / "*.jsonl").string());
  REQUIRE(pattern.files.size() == 1);
  CHECK(pattern.files[0].filename() == "b.jsonl");

  CHECK_THAT(error_of([&] { mt::data::resolve_data_files((dir / "set").string(), "test"); }),
             Catch::Contains("--dataset-subset 'test'") && Catch::Contains("its subsets: train, valid"));
  CHECK_THAT(error_of([&] { mt::data::resolve_data_files((dir / "set" / "train" / "b.jsonl").string(), "x"); }),
             Catch::Contains("is not a folder"));
  CHECK_THAT(error_of([&] { mt::data::resolve_data_files((dir / "set" / "valid").string()); }),
             Catch::Contains("holds no .txt, .jsonl, .json or .bin file"));
  CHECK_THAT(error_of([&] { mt::data::resolve_data_files((dir / "*.none").string()); }),
             Catch::Contains("the pattern matches no file"));
  std::ofstream(dir / "set" / "train" / "ids.bin") << "x";
  CHECK_THAT(error_of([&] { mt::data::resolve_data_files((dir / "set" / "train").string()); }),
             Catch::Contains("mixes 1 llm.c .bin token file(s) with 2 text/JSONL file(s)"));
  fs::remove_all(dir);
}

TEST_CASE("the token cache is written once, mapped after, and replaced when a file or the tokenizer changes",
          "[dataset][cache]") {
  const auto dir = fresh_dir("cache");
  const auto data = dir / "data";
  fs::create_directories(data);
  std::ofstream(data / "a.txt") << "first document\n\nsecond document\n";
  {
    std::ofstream out(data / "b.jsonl");
    out << R"({"text": "third"})"
        << "\n\n"
        << R"({"instruction": "add", "input": "", "output": "4"})"
        << "\n";
  }
  const mt::data::DatasetRequest request{.name = data.string(), .model = "llama-tiny"};
  mt::data::CachedDataset dataset(request, 2);
  CHECK(dataset.cache_path().parent_path() == data / ".meshtorch-cache");

  bool built = false;
  const auto cached = dataset.open_or_build(&built);
  CHECK(built);
  // The byte tokenizer's ids of the same documents, in file order.
  std::vector<std::int32_t> want;
  const mt::data::ByteTokenizer bytes;
  for (const char* text : {"first document", "second document", "third"}) bytes.encode_document(text, want);
  bytes.encode_document(mt::data::format_alpaca("add", "", "4"), want);
  REQUIRE(cached.count == want.size());
  CHECK(cached.id_bytes == 2);  // the byte tokenizer's 258 ids fit 16 bits: half the file
  CHECK(cached.to_vector() == want);
  CHECK(cached.stats.files == 2);
  CHECK(cached.stats.documents == 4);
  CHECK(cached.stats.skipped_lines == 1);
  CHECK(cached.min_id == *std::ranges::min_element(want));
  CHECK(cached.max_id == *std::ranges::max_element(want));
  CHECK(fs::file_size(dataset.cache_path()) == want.size() * 2 + sizeof(mt::data::TokenCacheFooter));

  const auto blocks = mt::data::blocks_of(cached, 8, dataset.source_name());
  CHECK(blocks.size() == static_cast<std::int64_t>(want.size() / 8));
  CHECK(blocks.dropped_tokens() == static_cast<std::int64_t>(want.size() % 8));
  want.resize(want.size() / 8 * 8);
  CHECK(all_tokens(blocks) == want);
  const auto report = dataset.report(cached, 8, built);
  CHECK_THAT(report, Catch::Contains("2 file(s), 4 document(s)") && Catch::Contains("1 blank line(s) skipped") &&
                         Catch::Contains("(written now)"));
  CHECK_THAT(error_of([&] { blocks.check_vocab(257); }), Catch::Contains("token id 257 lies outside"));

  // A second start maps the same file: no write.
  const auto written = fs::last_write_time(dataset.cache_path());
  const auto again = mt::data::CachedDataset(request).open_or_build(&built);
  CHECK_FALSE(built);
  CHECK(fs::last_write_time(dataset.cache_path()) == written);
  CHECK(again.to_vector() == cached.to_vector());
  CHECK(again.ids.get() != cached.ids.get());  // a mapping of its own, not a copy in this process

  // A cut-short file is refused with the reason and written again (as a new file, renamed over the
  // old one: a mapping in a running job keeps its pages).
  const std::vector<std::int32_t> cached_ids = cached.to_vector();
  fs::resize_file(dataset.cache_path(), fs::file_size(dataset.cache_path()) - 3);
  std::string why;
  CHECK_FALSE(dataset.open(&why));
  CHECK_THAT(why, Catch::Contains("no token-cache footer"));
  const auto rewritten = mt::data::CachedDataset(request).open_or_build(&built);
  CHECK(built);
  CHECK(rewritten.to_vector() == cached_ids);

  // An edited file, or a folder tokenizer, gives another key and another file.
  std::ofstream(data / "a.txt", std::ios::app) << "\nmore\n";
  const mt::data::CachedDataset edited(request);
  CHECK(edited.cache_path() != dataset.cache_path());
  const auto model = dir / "model";
  fs::create_directories(model);
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", model / "tokenizer.json");
  fs::copy_file(fixtures / "bpe" / "tokenizer_config.json", model / "tokenizer_config.json");
  mt::data::CachedDataset with_tokenizer({.name = data.string(), .model = model.string()});
  CHECK(with_tokenizer.cache_path() != edited.cache_path());
  with_tokenizer.open_or_build(&built);
  CHECK(built);
  CHECK_THAT(with_tokenizer.tokenizer_note(), Catch::Contains("byte-level BPE"));
  // A second start finds the cache current without loading the tokenizer.
  mt::data::CachedDataset cached_start({.name = data.string(), .model = model.string()});
  cached_start.open_or_build(&built);
  CHECK_FALSE(built);
  CHECK_THAT(cached_start.tokenizer_note(), Catch::Contains("not loaded: its token cache is current"));

  // 32-bit ids (a vocabulary over 65536, Llama 3's), and an id that breaks a 16-bit promise.
  {
    const std::vector<std::int32_t> ids{5, 128000, 3};
    mt::data::TokenCacheWriter wide(dir / "wide.ids", 7, 4);
    wide.append(ids);
    wide.finish({});
    const auto opened = mt::data::open_token_cache(dir / "wide.ids", 7);
    REQUIRE(opened);
    CHECK(opened->id_bytes == 4);
    CHECK(opened->to_vector() == ids);
    CHECK(opened->max_id == 128000);
    CHECK(all_tokens(mt::data::blocks_of(*opened, 3, "wide")) == ids);
    std::string why;
    CHECK_FALSE(mt::data::open_token_cache(dir / "wide.ids", 8, &why));
    CHECK_THAT(why, Catch::Contains("made for key 0000000000000007, not 0000000000000008"));
    mt::data::TokenCacheWriter narrow(dir / "narrow.ids", 8, 2);
    CHECK_THAT(error_of([&] { narrow.append(ids); }), Catch::Contains("token id 128000 does not fit the 16 bits"));
  }

  // $MESHTORCH_DATA_CACHE moves it (a node-local folder).
  ::setenv("MESHTORCH_DATA_CACHE", (dir / "elsewhere").c_str(), 1);
  const mt::data::CachedDataset moved(request);
  ::unsetenv("MESHTORCH_DATA_CACHE");
  CHECK(moved.cache_path().parent_path() == dir / "elsewhere");
  fs::remove_all(dir);
}

TEST_CASE("conversations are written in the folder's chat template and keep the template's own tokens",
          "[dataset][chat]") {
  const auto dir = fresh_dir("chat");
  const auto model = dir / "model";
  fs::create_directories(model);
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", model / "tokenizer.json");
  // The template in tokenizer_config.json as a list of named templates (the older layout).
  const std::string chat =
      "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
      "{{ raise_exception('this template knows no role ' + m['role']) }}{% endif %}"
      "{{ m['role'] }}: {{ m['content'] | trim }}<|eot_id|>{% endfor %}";
  auto config = nlohmann::json::parse(std::ifstream(fixtures / "bpe" / "tokenizer_config.json"));
  config["chat_template"] = {{{"name", "tool_use"}, {"template", "unused"}}, {{"name", "default"}, {"template", chat}}};
  std::ofstream(model / "tokenizer_config.json") << config.dump();

  const auto data = dir / "data";
  fs::create_directories(data);
  {
    std::ofstream out(data / "chat.jsonl");
    out << R"({"messages": [{"role": "user", "content": " Hi 🙂 "}, {"role": "assistant", "content": "Hello."}]})"
        << "\n"
        << R"({"text": "plain text between"})"
        << "\n";
  }
  const auto tokenizer = mt::data::load_tokenizer(model);
  std::vector<std::int32_t> want =
      tokenizer->encode("<|begin_of_text|>user: Hi 🙂<|eot_id|>assistant: Hello.<|eot_id|>");
  const std::vector<std::string> plain{"plain text between"};
  const auto framed = tokenizer->encode_documents(plain, 1);
  want.insert(want.end(), framed.begin(), framed.end());
  CHECK(want.front() == 0);  // one <|begin_of_text|>, the template's: nothing added to a conversation

  mt::data::CachedDataset dataset({.name = data.string(), .model = model.string()}, 1);
  bool built = false;
  const auto cached = dataset.open_or_build(&built);
  CHECK(built);
  CHECK(cached.to_vector() == want);
  CHECK_THAT(dataset.tokenizer_note(), Catch::Contains("chat template") && Catch::Contains("'chat_template'"));

  // chat_template.jinja (what transformers 5 writes) wins over tokenizer_config.json, and a new
  // template is a new cache.
  std::ofstream(model / "chat_template.jinja") << "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}";
  mt::data::CachedDataset with_file({.name = data.string(), .model = model.string()}, 1);
  CHECK(with_file.cache_path() != dataset.cache_path());
  const auto rewritten = with_file.open_or_build(&built);
  CHECK(built);
  auto want_file = tokenizer->encode("[user]  Hi 🙂 \n[assistant] Hello.\n");
  want_file.insert(want_file.end(), framed.begin(), framed.end());
  CHECK(rewritten.to_vector() == want_file);
  fs::remove(model / "chat_template.jinja");

  // The template's raise_exception, and records that are not conversations, name file and line.
  auto build_error = [&](const std::string& line) {
    std::ofstream(data / "chat.jsonl") << "{\"text\": \"first\"}\n" << line << "\n";
    return error_of([&] { mt::data::CachedDataset({.name = data.string(), .model = model.string()}, 1).build(); });
  };
  const auto where = (data / "chat.jsonl").string() + ":2";
  CHECK_THAT(build_error(R"({"messages": [{"role": "system", "content": "x"}]})"),
             Catch::Contains(where) && Catch::Contains("this template knows no role system"));
  CHECK_THAT(build_error(R"({"messages": []})"), Catch::Contains(where) && Catch::Contains("non-empty list"));
  CHECK_THAT(build_error(R"({"messages": [{"content": "x"}]})"),
             Catch::Contains(where) && Catch::Contains("messages[0] needs a string 'role'"));
  CHECK_THAT(build_error(R"({"messages": [{"role": "user", "content": 5}]})"),
             Catch::Contains("messages[0] 'content' must be a string, a list or null"));
  CHECK_THAT(build_error(R"({"messages": [{"role": "user", "content": "x"}], "tools": "all"})"),
             Catch::Contains("'tools' must be a list"));

  // A conversation without a template (the byte tokenizer, or a folder without one) names the fix.
  std::ofstream(data / "chat.jsonl") << R"({"messages": [{"role": "user", "content": "x"}]})"
                                     << "\n";
  CHECK_THAT(error_of([&] { mt::data::CachedDataset({.name = data.string(), .model = "llama-tiny"}).build(); }),
             Catch::Contains((data / "chat.jsonl").string() + ":1") &&
                 Catch::Contains("-m must name a model folder with chat_template.jinja"));

  // A template that does not parse, or a list without "default", names the file.
  config["chat_template"] = "{% for m in messages %}unclosed";
  std::ofstream(model / "tokenizer_config.json") << config.dump();
  CHECK_THAT(error_of([&] { mt::data::ChatTemplate::from_folder(model); }),
             Catch::Contains("tokenizer_config.json 'chat_template'") && Catch::Contains("not valid Jinja"));
  config["chat_template"] = {{{"name", "tool_use"}, {"template", "x"}}, {{"name", "rag"}, {"template", "y"}}};
  std::ofstream(model / "tokenizer_config.json") << config.dump();
  CHECK_THAT(error_of([&] { mt::data::ChatTemplate::from_folder(model); }),
             Catch::Contains("names no 'default' template (it has: tool_use, rag)"));
  config.erase("chat_template");
  std::ofstream(model / "tokenizer_config.json") << config.dump();
  CHECK_FALSE(mt::data::ChatTemplate::from_folder(model).has_value());
  fs::remove_all(dir);
}
