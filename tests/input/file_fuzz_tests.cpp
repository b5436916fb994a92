// Fuzzing of the files a run reads besides config.json, the weights and state.json (those are in
// fuzz_tests.cpp): sharded checkpoints (manifest.json; the ranks' safetensors files and
// state.json with the manifest's checksums recomputed, so that a mutation reaches the parser),
// tokenizer.json, tokenizer.model, tokenizer_config.json with special_tokens_map.json and
// generation_config.json, chat templates, DeepSpeed configs, data files (JSONL, text, llm.c .bin)
// and token caches. Each goes through the entry point a run uses: the checkpoint's load and
// meshtorch-consolidate's consolidation, load_tokenizer and ChatTemplate::from_folder on the
// model folder, DeepSpeedConfig::read, load_dataset with -d and -m.
// fuzz_support.hpp has the mutations, the limits, and the variables that set the run.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/checkpoint/consolidate.hpp>
#include <meshtorch/checkpoint/load.hpp>
#include <meshtorch/checkpoint/save.hpp>
#include <meshtorch/data/chat_template.hpp>
#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>
#include <meshtorch/io/file_digest.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/train/checkpoint.hpp>
#include <meshtorch/train/deepspeed_config.hpp>
#include <meshtorch/train/rng.hpp>
#include <meshtorch/train/state.hpp>

#include "../core/test_support.hpp"
#include "fuzz_support.hpp"

namespace file_fuzz {

namespace mt = meshtorch;
namespace fs = std::filesystem;
namespace io = meshtorch::io;
namespace checkpoint = meshtorch::checkpoint;
using meshtorch::testing::fresh_dir;
using namespace meshtorch::testing::fuzz;

inline const fs::path fixtures = MESHTORCH_DATA_FIXTURES;

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Runs `first` and then `second` (two entry points on one input), the second even when the first
// refused the input by name; that refusal is rethrown at the end. Anything else ends at once.
template <class First, class Second>
void both(First&& first, Second&& second) {
  std::exception_ptr refusal;
  try {
    first();
  } catch (const mt::ConfigError&) {
    refusal = std::current_exception();
  } catch (const mt::DataError&) {
    refusal = std::current_exception();
  }
  second();
  if (refusal) std::rethrow_exception(refusal);
}

// The safetensors header of `file` as JSON, and its data section.
std::pair<nlohmann::json, std::string> split_safetensors(const std::string& file) {
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | static_cast<unsigned char>(file[i]);
  return {nlohmann::json::parse(file.substr(8, header_size)), file.substr(8 + header_size)};
}

std::string frame_safetensors(const std::string& header, const std::string& data) {
  std::string file;
  for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>(static_cast<std::uint64_t>(header.size()) >> (8 * i)));
  return file + header + data;
}

// A checkpoint saved by two simulated ranks (FSDP 2: each writes half the rows), with per-rank
// state and a config.json, as a run's save leaves it: <exp>/ckpt-00000002/ and the link.
struct CheckpointFixture {
  fs::path exp, dir;
  std::map<std::string, std::string> originals;  // every file of the folder, as saved
  const mt::train::RunIdentity identity{.seed = 4, .seq_length = 8, .global_batch = 2, .dataset = "d", .model = "m"};
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> specs{
      {"model.embed_tokens.weight", {6, 4}}, {"model.norm.weight", {4}}, {"lm_head.weight", {6, 4}}};

  explicit CheckpointFixture(const std::string& name) : exp(fresh_dir(name)) {
    const auto partial = exp / (checkpoint::sharded_checkpoint_name(2) + ".partial");
    fs::create_directories(partial);
    for (int rank = 0; rank < 2; ++rank) {
      std::vector<io::ShardedTensor> pieces;
      for (const auto& [tensor, shape] : specs) {
        const auto full = torch::arange(io::whole(shape).numel(), torch::kFloat).view(shape);
        const auto half = shape[0] / 2;
        const auto box = io::rows(io::whole(shape), rank * half, (rank + 1) * half);
        pieces.push_back(io::sharded(tensor, full.narrow(0, rank * half, half).clone(), shape, box));
      }
      checkpoint::write_rank_pieces(partial, rank, 2, pieces, mt::train::capture_rng_states());
    }
    checkpoint::SaveOptions options;
    options.extra_files["config.json"] = "{}\n";
    const auto state = mt::train::to_json(
        {.epoch = 0, .global_step = 2, .epoch_step = 2, .running_loss = 2.5, .running_steps = 2}, identity);
    checkpoint::publish_sharded_checkpoint(exp, 2, 2, state, options);
    dir = exp / checkpoint::sharded_checkpoint_name(2);
    for (const auto& entry : fs::directory_iterator(dir))
      originals[entry.path().filename().string()] = read_bytes(entry.path());
  }
  ~CheckpointFixture() {
    std::error_code ignored;
    fs::remove_all(exp, ignored);
  }

  void restore() const {
    for (const auto& [name, bytes] : originals) write_bytes(dir / name, bytes);
  }

  // The manifest's size and checksum of every file recomputed, so that a changed file passes
  // the checksum and reaches the parser, as a hostile checkpoint would.
  void refix_manifest() const {
    auto manifest = nlohmann::json::parse(read_bytes(dir / "manifest.json"));
    for (auto& [name, digest] : manifest["files"].items()) {
      const auto actual = io::digest_file(dir / name);
      digest = {{"bytes", actual.bytes}, {"xxh3", io::checksum_hex(actual.xxh3)}};
    }
    write_bytes(dir / "manifest.json", manifest.dump());
  }

  // What a resume does on rank 0 of the saved world, then what meshtorch-consolidate does.
  void resume_and_consolidate() const {
    both(
        [&] {
          const auto point = checkpoint::find_checkpoint_to_resume(exp);
          REQUIRE(point.checkpoint);
          std::vector<io::ShardedTensor> targets;
          for (const auto& [tensor, shape] : specs)
            targets.push_back(io::replicated(tensor, torch::zeros(shape), true));
          const auto loaded = checkpoint::load_sharded_checkpoint(*point.checkpoint, targets, 0, 2);
          const auto state = mt::train::read_train_state(loaded.state, (dir / "state.json").string(), identity);
          CHECK(state.global_step >= 0);
          if (loaded.rank_state)
            mt::train::restore_rng_states(io::SafetensorsFile{*loaded.rank_state, {}}, dir / "rank0.safetensors");
          for (const auto& target : targets) CHECK(target.local.sizes() == target.box.sizes);
        },
        [&] {
          const auto out = exp / "consolidated";
          fs::remove_all(out);
          checkpoint::consolidate_sharded_checkpoint(dir, out);
          // What it wrote is an HF folder the model-folder reader takes.
          const auto weights = io::load_safetensors(out / "model.safetensors");
          CHECK(weights.tensors.size() <= specs.size());
        });
  }
};

// The model folder the tokenizer, template and data cases read: the fixture's byte-level BPE
// tokenizer.json (Llama 3's pre-tokenizer, <|begin_of_text|> = 0, <|end_of_text|> = 1,
// <|eot_id|> = 2), its tokenizer_config.json, and a Llama 3 style chat template.
const char* const chat_template_source = R"({{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nTools:\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=2) + '\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['content'] is string %}{%- set content = message['content'] %}
{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}{%- endif %}
{%- if loop.first and message['role'] != 'system' %}{{- '<|start_header_id|>system<|end_header_id|>\n\n<|eot_id|>' }}{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
)";

const nlohmann::ordered_json& conversation() {
  static const auto messages = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
    {"role": "assistant", "content": "Hi there."}])");
  return messages;
}

const nlohmann::ordered_json& tools() {
  static const auto list = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}])");
  return list;
}

fs::path make_model_folder(const fs::path& dir) {
  fs::create_directories(dir);
  fs::copy_file(fixtures / "bpe" / "tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  fs::copy_file(fixtures / "bpe" / "tokenizer_config.json", dir / "tokenizer_config.json",
                fs::copy_options::overwrite_existing);
  write_bytes(dir / "chat_template.jinja", chat_template_source);
  return dir;
}

// The ids of a few texts: every id a tokenizer gives must index its vocabulary (the embedding).
void check_encodes(const mt::data::TextTokenizer& tokenizer) {
  const auto vocab = tokenizer.vocab_size();
  REQUIRE(vocab > 0);
  for (const std::string text :
       {"Hello, world!", " DON'T  shout\n\n1234 <|eot_id|> caf\xc3\xa9 \xf0\x9f\x99\x82", ""}) {
    const auto ids = tokenizer.encode(text);
    for (const auto id : ids) CHECK((id >= 0 && id < vocab));
    tokenizer.decode(ids);
    // With the special tokens the post-processor's template adds (meshtorch-generate's prompts).
    for (const auto id : tokenizer.encode_with_special_tokens(text)) CHECK((id >= 0 && id < vocab));
  }
  for (const auto& id : {tokenizer.bos_id, tokenizer.eos_id})
    if (id) CHECK((*id >= 0 && *id < vocab));
}

// What a run does with a model folder's tokenizer files: the tokenizer, its bos/eos, the chat
// template and one rendering of a conversation with tools.
void load_folder_tokenizer(const fs::path& dir) {
  both([&] { check_encodes(*mt::data::load_tokenizer(dir)); },
       [&] {
         auto chat = mt::data::ChatTemplate::from_folder(dir);
         if (!chat) return;
         auto limits = mt::data::ChatTemplateLimits::from_environment();
         limits.max_seconds = 2;  // a slow input ends sooner; the limit itself is tested in the data tests
         chat->set_limits(limits);
         chat->render(conversation(), tools(), true, "conversation");
         chat->render(conversation(), nullptr, false, "conversation");
       });
}

// The training data of -d `data` with -m `model`, through the token cache, and every block of it.
void load_blocks(const fs::path& data, const fs::path& model, std::int64_t vocab_size) {
  const auto blocks = mt::data::load_dataset(data.string(), 4, model.string());
  blocks.check_vocab(vocab_size);
  std::vector<std::int64_t> all(static_cast<std::size_t>(blocks.size()));
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::int64_t>(i);
  const auto rows = blocks.gather(all);
  // check_vocab passed, so every id the loader hands on is in the vocabulary.
  if (rows.numel() > 0) {
    CHECK(rows.min().item<std::int64_t>() >= 0);
    CHECK(rows.max().item<std::int64_t>() < vocab_size);
  }
}

// Points the token cache at a folder of its own (the data's folder is rewritten by every input).
struct TokenCacheFolder {
  fs::path dir;
  explicit TokenCacheFolder(const fs::path& root) : dir(root / "cache") {
    fs::create_directories(dir);
    ::setenv("MESHTORCH_DATA_CACHE", dir.c_str(), 1);
  }
  ~TokenCacheFolder() { ::unsetenv("MESHTORCH_DATA_CACHE"); }
  void clear() const {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
};

std::vector<std::string> corpus_lines() {
  std::vector<std::string> lines;
  std::ifstream in(fixtures / "corpus.jsonl");
  std::string line;
  while (std::getline(in, line) && lines.size() < 12) lines.push_back(nlohmann::json::parse(line).get<std::string>());
  return lines;
}

}  // namespace file_fuzz

using namespace file_fuzz;

TEST_CASE("fuzzed checkpoint manifests resume, consolidate or give a named error", "[fuzz]") {
  CheckpointFixture fixture("fuzz-manifest");
  const auto manifest = nlohmann::json::parse(fixture.originals.at("manifest.json"));
  const std::vector<nlohmann::json> likely = {"rank0.safetensors",
                                              "rank1.safetensors",
                                              "state.json",
                                              "config.json",
                                              "manifest.json",
                                              "../outside",
                                              "/etc/passwd",
                                              "model.norm.weight",
                                              "lm_head.weight",
                                              "F32",
                                              "BF16",
                                              "I64",
                                              0,
                                              1,
                                              2,
                                              3,
                                              6,
                                              nlohmann::json::array({0, 0}),
                                              nlohmann::json::array({3, 4}),
                                              nlohmann::json::array({6, 4}),
                                              nlohmann::json::array({120000})};
  Mutator mutator(seed_for(11));
  FuzzTally tally("manifest.json");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    fixture.restore();
    const auto text = mutator.mutate_json(manifest, likely);
    write_bytes(fixture.dir / "manifest.json", text);
    tally.run(input, text, [&] { fixture.resume_and_consolidate(); });
  }
  tally.report();
}

TEST_CASE("fuzzed checkpoint files with recomputed checksums resume, consolidate or give a named error", "[fuzz]") {
  CheckpointFixture fixture("fuzz-checkpoint-files");
  const std::vector<nlohmann::json> likely = {"model.norm.weight",
                                              "lm_head.weight",
                                              "rank0/rng.cpu",
                                              "F32",
                                              "BF16",
                                              "U8",
                                              "I64",
                                              nlohmann::json::array({0, 48}),
                                              nlohmann::json::array({3, 4}),
                                              nlohmann::json::array({0, 0}),
                                              48,
                                              2,
                                              2.5};
  Mutator mutator(seed_for(12));
  FuzzTally tally("checkpoint files");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    fixture.restore();
    // A rank's safetensors file (its header re-framed with its true length, or any of its bytes),
    // or state.json.
    const auto choice = mutator.below(5);
    const std::string name = choice == 4 ? "state.json" : fmt::format("rank{}.safetensors", choice % 2);
    const auto& original = fixture.originals.at(name);
    std::string file;
    if (name == "state.json") {
      file = mutator.mutate_json(nlohmann::json::parse(original), likely);
    } else if (choice < 2) {
      file = mutator.mutate_binary(original, {0, 4});
    } else {
      const auto [header, data] = split_safetensors(original);
      file = frame_safetensors(mutator.mutate_json(header, likely), data);
    }
    write_bytes(fixture.dir / name, file);
    fixture.refix_manifest();
    tally.run(input, name + ": " + (name == "state.json" ? file : file.substr(8)),
              [&] { fixture.resume_and_consolidate(); });
  }
  tally.report();
}

TEST_CASE("fuzzed tokenizer.json files load a tokenizer or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-tokenizer-json");
  const auto dir = make_model_folder(root / "model");
  const auto seed = nlohmann::json::parse(read_bytes(dir / "tokenizer.json"));
  const std::vector<nlohmann::json> likely = {"BPE",
                                              "ByteLevel",
                                              "Sequence",
                                              "Split",
                                              "<|begin_of_text|>",
                                              "<|eot_id|>",
                                              "Ġ",
                                              "Ġ t",
                                              nlohmann::json::array({"Ġ", "t"}),
                                              0,
                                              2,
                                              255,
                                              300000000,
                                              std::int64_t{2147483647},
                                              nlohmann::json::object({{"Regex", "\\s+"}}),
                                              nlohmann::json::object({{"Regex", "(((("}})};
  Mutator mutator(seed_for(13));
  FuzzTally tally("tokenizer.json");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_bytes(dir / "tokenizer.json", text);
    tally.run(input, text, [&] { load_folder_tokenizer(dir); });
  }
  tally.report();
  fs::remove_all(root);
}

// The same with a post-processor: Llama 3's TemplateProcessing, <|begin_of_text|> before each text.
TEST_CASE("fuzzed tokenizer.json post-processor templates load a tokenizer or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-post-processor");
  const auto dir = make_model_folder(root / "model");
  auto seed = nlohmann::json::parse(read_bytes(dir / "tokenizer.json"));
  const nlohmann::json bos = {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}};
  seed["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       nlohmann::json::array(
           {{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}},
            {{"type", "TemplateProcessing"},
             {"single", nlohmann::json::array({bos, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
             {"pair", nlohmann::json::array({bos,
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                             bos,
                                             {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
             {"special_tokens",
              {{"<|begin_of_text|>",
                {{"id", "<|begin_of_text|>"}, {"ids", {0}}, {"tokens", {"<|begin_of_text|>"}}}}}}}})}};
  const std::vector<nlohmann::json> likely = {"TemplateProcessing",
                                              "RobertaProcessing",
                                              "SpecialToken",
                                              "Sequence",
                                              "A",
                                              "B",
                                              "<|begin_of_text|>",
                                              "<|eot_id|>",
                                              nlohmann::json::array({0, 1}),
                                              -1,
                                              std::int64_t{2147483647},
                                              nullptr};
  Mutator mutator(seed_for(23));
  FuzzTally tally("tokenizer.json post-processor");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(seed, likely);
    write_bytes(dir / "tokenizer.json", text);
    tally.run(input, text, [&] { load_folder_tokenizer(dir); });
  }
  tally.report();
  fs::remove_all(root);
}

TEST_CASE("fuzzed tokenizer.model files load a tokenizer or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-tokenizer-model");
  const auto dir = root / "model";
  fs::create_directories(dir);
  const auto original = read_bytes(fixtures / "sentencepiece" / "tokenizer.model");
  Mutator mutator(seed_for(14));
  FuzzTally tally("tokenizer.model");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    // Protobuf: a field's tag and length lead it, so the first bytes and the lengths matter most.
    const auto bytes = mutator.mutate_binary(original, {0, 1, 2, 3, 8, 16});
    write_bytes(dir / "tokenizer.model", bytes);
    tally.run(input, "(binary)", [&] { check_encodes(*mt::data::load_tokenizer(dir)); });
  }
  tally.report();
  fs::remove_all(root);
}

TEST_CASE(
    "fuzzed tokenizer_config.json, special_tokens_map.json and generation_config.json load or give a named "
    "error",
    "[fuzz]") {
  const auto root = fresh_dir("fuzz-tokenizer-config");
  const auto dir = make_model_folder(root / "model");
  fs::remove(dir / "chat_template.jinja");  // the template comes from tokenizer_config.json here
  const nlohmann::json config = {
      {"bos_token", "<|begin_of_text|>"},
      {"eos_token", {{"content", "<|eot_id|>"}, {"lstrip", false}, {"special", true}}},
      {"pad_token", nullptr},
      {"add_bos_token", true},
      {"chat_template", nlohmann::json::array({{{"name", "default"}, {"template", chat_template_source}},
                                               {{"name", "tool_use"}, {"template", "{{ messages[0] }}"}}})},
      {"tokenizer_class", "PreTrainedTokenizerFast"}};
  const nlohmann::json special_tokens = {
      {"bos_token", "<|begin_of_text|>"}, {"eos_token", {{"content", "<|end_of_text|>"}}}, {"unk_token", "<|eot_id|>"}};
  const nlohmann::json generation = {{"bos_token_id", 0}, {"eos_token_id", nlohmann::json::array({1, 2})}};
  const std::vector<std::pair<std::string, nlohmann::json>> files = {{"tokenizer_config.json", config},
                                                                     {"special_tokens_map.json", special_tokens},
                                                                     {"generation_config.json", generation}};
  const std::vector<nlohmann::json> likely = {"<|begin_of_text|>",
                                              "<|end_of_text|>",
                                              "<|eot_id|>",
                                              "no such token",
                                              "default",
                                              "{{ raise_exception('refused') }}",
                                              "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                              0,
                                              1,
                                              2,
                                              255,
                                              300000000,
                                              nlohmann::json::array({1, 2}),
                                              nlohmann::json::object({{"content", "<|eot_id|>"}})};
  Mutator mutator(seed_for(15));
  FuzzTally tally("tokenizer_config.json and its siblings");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    for (const auto& [name, seed] : files) write_bytes(dir / name, seed.dump(2));
    const auto& [name, seed] = files[mutator.below(files.size())];
    const auto text = mutator.mutate_json(seed, likely);
    write_bytes(dir / name, text);
    tally.run(input, name + ": " + text, [&] { load_folder_tokenizer(dir); });
  }
  tally.report();
  fs::remove_all(root);
}

TEST_CASE("fuzzed chat templates render under their limits or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-chat-template");
  const auto dir = make_model_folder(root / "model");
  // Jinja that reaches minja's corners and meshtorch's limits.
  const std::vector<std::string> splices = {"{{",
                                            "}}",
                                            "{%",
                                            "%}",
                                            "{#",
                                            "-",
                                            "(",
                                            "[",
                                            "|",
                                            "'",
                                            "{% endfor %}",
                                            "{% endif %}",
                                            "{% for m in messages %}{{ m }}{% endfor %}",
                                            "{% for i in range(100000000) %}{% endfor %}",
                                            "{{ range(10000000000) | length }}",
                                            "{{ 'x' * 4000000000 }}",
                                            "{% set s = namespace(t='ab') %}{% for i in range(60) %}{% set s.t = s.t + "
                                            "s.t %}{% endfor %}",
                                            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                                            "{{ messages[99]['content'] }}",
                                            "{{ messages | tojson(indent=4000000000) }}",
                                            "{{ raise_exception('refused') }}",
                                            "{{ 1 / 0 }}",
                                            "{{ strftime_now('%Y-%m-%d' * 100) }}",
                                            "{{ messages[0]['content'] | replace('', 'xx') }}",
                                            "{{ tools | map(attribute='function') | list }}",
                                            "{{ loop.index }}",
                                            "{{ 9223372036854775807 + 1 }}",
                                            "{{ '%s' % messages }}",
                                            "{% if %}",
                                            std::string(300, '(') + "1" + std::string(300, ')')};
  const std::string seed = chat_template_source;
  Mutator mutator(seed_for(16));
  FuzzTally tally("chat template");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    std::string text = seed;
    const auto rounds = 1 + mutator.below(3);
    for (std::size_t i = 0; i < rounds; ++i) text = mutator.mutate_bytes(std::move(text), splices);
    // As chat_template.jinja, or as tokenizer_config.json's "chat_template".
    const bool in_config = mutator.below(3) == 0;
    if (in_config) {
      fs::remove(dir / "chat_template.jinja");
      auto config = nlohmann::json::parse(read_bytes(fixtures / "bpe" / "tokenizer_config.json"));
      config["chat_template"] = text;
      // Invalid UTF-8 cannot be a JSON string: such a template is written in a .jinja file.
      try {
        write_bytes(dir / "tokenizer_config.json", config.dump());
      } catch (const nlohmann::json::type_error&) {
        write_bytes(dir / "chat_template.jinja", text);
      }
    } else {
      fs::copy_file(fixtures / "bpe" / "tokenizer_config.json", dir / "tokenizer_config.json",
                    fs::copy_options::overwrite_existing);
      write_bytes(dir / "chat_template.jinja", text);
    }
    tally.run(input, text, [&] { load_folder_tokenizer(dir); });
  }
  tally.report();
  fs::remove_all(root);
}

TEST_CASE("fuzzed DeepSpeed configs load or give a named error", "[fuzz]") {
  const auto dir = fresh_dir("fuzz-deepspeed");
  const auto path = dir / "ds_config.json";
  // Chapter 8's config (ZeRO stage 2), and one with stage 3 offloading both states to the CPU.
  const auto stage2 = nlohmann::json::parse(R"({
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "bf16": {"enabled": false},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"total_num_steps": 1000, "warmup_num_steps": 20, "warmup_type": "linear",
                             "cos_min_ratio": 0.01}},
    "zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": true, "reduce_bucket_size": 5e6},
    "gradient_clipping": 1.0, "steps_per_print": 10})");
  const auto stage3 = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})");
  const std::vector<nlohmann::json> likely = {
      "AdamW", "Adam", "WarmupCosineLR", "WarmupDecayLR", "cpu", "none", "linear", "log", 0, 1, 2, 3, 4, 8, 1e-3};
  Mutator mutator(seed_for(17));
  FuzzTally tally("DeepSpeed config");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    const auto text = mutator.mutate_json(input % 2 ? stage3 : stage2, likely);
    write_bytes(path, text);
    tally.run(input, text, [&] {
      auto config = mt::train::DeepSpeedConfig::read(path);
      config.resolve_batch(1);
      const auto schedule = config.schedule();
      for (const std::int64_t step : {0, 1, 20, 999, 1000, 100000}) CHECK(std::isfinite(schedule.lr_at(step)));
      CHECK(*config.micro_batch_per_gpu > 0);
      CHECK(*config.gradient_accumulation_steps > 0);
    });
  }
  tally.report();
  fs::remove_all(dir);
}

TEST_CASE("fuzzed JSONL and text data files load as blocks or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-jsonl");
  const auto model = make_model_folder(root / "model");
  const TokenCacheFolder cache(root);
  const auto vocab = mt::data::load_tokenizer(model)->vocab_size();
  std::vector<nlohmann::json> records;
  for (const auto& line : corpus_lines()) records.push_back({{"text", line}});
  records.push_back({{"instruction", "Add."}, {"input", "1 and 2"}, {"output", "3"}});
  records.push_back(
      {{"messages", nlohmann::json::parse(conversation().dump())}, {"tools", nlohmann::json::parse(tools().dump())}});
  std::string jsonl, text;
  for (const auto& record : records) jsonl += record.dump() + "\n";
  for (const auto& line : corpus_lines()) text += line + "\n\n";
  const std::vector<nlohmann::json> likely = {
      "text", "messages", "user", "assistant", "tool", nlohmann::json::array(), nlohmann::json::object({{"text", 1}})};
  Mutator mutator(seed_for(18));
  FuzzTally tally("JSONL and text data");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    cache.clear();
    const bool is_text = input % 3 == 2;
    const auto data = root / (is_text ? "corpus.txt" : "corpus.jsonl");
    std::string bytes;
    if (is_text) {
      bytes = mutator.mutate_bytes(text);
    } else if (mutator.below(2)) {  // one record changed as JSON
      const auto at = mutator.below(records.size());
      for (std::size_t i = 0; i < records.size(); ++i) {
        auto line = i == at ? mutator.mutate_json(records[i], likely) : records[i].dump();
        std::replace(line.begin(), line.end(), '\n', ' ');
        bytes += line + "\n";
      }
    } else {
      bytes = mutator.mutate_bytes(jsonl);
    }
    fs::remove(root / "corpus.txt");
    fs::remove(root / "corpus.jsonl");
    write_bytes(data, bytes);
    tally.run(input, bytes, [&] { load_blocks(data, model, vocab); });
  }
  tally.report();
  fs::remove_all(root);
}

TEST_CASE("fuzzed llm.c token files load as blocks or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-llmc");
  const auto model = make_model_folder(root / "model");
  const TokenCacheFolder cache(root);
  std::string original(1024, '\0');
  const std::int32_t header[3] = {20240520, 1, 64};
  std::memcpy(original.data(), header, sizeof header);
  for (std::uint16_t i = 0; i < 64; ++i) {
    const std::uint16_t id = static_cast<std::uint16_t>((i * 37) % 200);
    original.append(reinterpret_cast<const char*>(&id), 2);
  }
  Mutator mutator(seed_for(19));
  FuzzTally tally("llm.c .bin");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    cache.clear();
    const auto data = root / "train.bin";
    const auto bytes = mutator.mutate_binary(original, {0, 4, 8, 12, 1024});
    write_bytes(data, bytes);
    tally.run(input, "(binary)", [&] { load_blocks(data, model, 65536); });
  }
  tally.report();
  fs::remove_all(root);
}

TEST_CASE("fuzzed token cache files are used, rebuilt or give a named error", "[fuzz]") {
  const auto root = fresh_dir("fuzz-token-cache");
  const auto model = make_model_folder(root / "model");
  const TokenCacheFolder cache(root);
  const auto vocab = mt::data::load_tokenizer(model)->vocab_size();
  const auto data = root / "corpus.jsonl";
  {
    std::string jsonl;
    for (const auto& line : corpus_lines()) jsonl += nlohmann::json({{"text", line}}).dump() + "\n";
    write_bytes(data, jsonl);
  }
  load_blocks(data, model, vocab);  // writes the cache
  std::vector<fs::path> written;
  for (const auto& entry : fs::directory_iterator(cache.dir)) written.push_back(entry.path());
  REQUIRE(written.size() == 1);
  const auto cache_file = written.front();
  const auto original = read_bytes(cache_file);
  REQUIRE(original.size() > 64);
  // The footer's fields (token_cache.hpp's TokenCacheFooter), but not its key: a cache of another
  // key is not read, it is rebuilt.
  const auto footer = original.size() - 64;
  const std::vector<std::size_t> fields = {0,           footer + 16, footer + 24, footer + 32,
                                           footer + 40, footer + 44, footer + 48, footer + 56};
  Mutator mutator(seed_for(20));
  FuzzTally tally("token cache");
  for (std::uint64_t input = 0; input < iterations(); ++input) {
    cache.clear();
    auto bytes = mutator.mutate_binary(original, fields);
    // Keep the key (bytes 8-15 of the footer, which sits at the end) where it was, when the file
    // is still long enough: otherwise the mutation never reaches the checks past the key.
    if (bytes.size() >= 64 && bytes.size() != original.size() && mutator.below(2))
      bytes.replace(bytes.size() - 64, 64, original.substr(footer));
    write_bytes(cache_file, bytes);
    tally.run(input, "(binary)", [&] { load_blocks(data, model, vocab); });
  }
  tally.report();
  fs::remove_all(root);
}

// The harness itself: under the fuzz tests' address-space limit, an allocation of gigabytes is an
// exception the tally reports (std::bad_alloc, or LibTorch's error), not an out-of-memory kill.
TEST_CASE("the fuzz tests' memory limit turns an allocation of gigabytes into an error", "[fuzz]") {
  limit_memory();
  const std::size_t too_much = std::size_t{8} << 30;
  CHECK_THROWS_AS(std::vector<char>(too_much), std::bad_alloc);
  CHECK_THROWS_WITH(torch::empty({static_cast<std::int64_t>(too_much)}, torch::kByte),
                    Catch::Contains("allocate") || Catch::Contains("memory"));
  CHECK_NOTHROW(std::vector<char>(std::size_t{256} << 20));
}
