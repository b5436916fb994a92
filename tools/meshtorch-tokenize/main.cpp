// meshtorch-tokenize: a model folder's tokenizer (tokenizer.json or tokenizer.model) from the
// shell. Each line of standard input becomes one line of output: its ids as a JSON array
// (without added <bos>/<eos>, as HF's add_special_tokens=False), or with --decode, a JSON array of
// ids becomes its text. With --json, texts are JSON strings on both sides, so they may hold newlines.
// With --chat, each line is a conversation ({"messages": [...], "tools": [...]} as in a JSONL data
// set, or the list of messages alone) written in the folder's chat template, and its ids are
// printed as apply_chat_template(tokenize=True) gives them; --chat-text prints the rendered text
// as a JSON string instead. With --prepare DATA, it tokenises a data set (-d's file, folder or
// pattern) into its token cache once, before a job, as the first training start would, and says
// what it did as JSON.
#include <chrono>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/data/cached_dataset.hpp>
#include <meshtorch/data/chat_template.hpp>
#include <meshtorch/data/documents.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>
#include <meshtorch/io/json_file.hpp>

namespace mt = meshtorch;

namespace {

// Lines are encoded in batches, so that several threads work while output stays in input order.
void encode_lines(const mt::data::TextTokenizer& tokenizer, unsigned threads, bool json) {
  constexpr std::size_t batch_lines = 4096;
  std::vector<std::string> lines;
  std::size_t number = 0;
  auto flush = [&] {
    for (const auto& ids : tokenizer.encode_batch(lines, threads)) std::cout << nlohmann::json(ids).dump() << '\n';
    lines.clear();
  };
  for (std::string line; std::getline(std::cin, line);) {
    ++number;
    if (json) {
      const auto where = fmt::format("standard input line {}", number);
      const auto value = mt::io::parse_json<mt::DataError>(line, where, "the line");  // bounded: depth, size
      if (!value.is_string()) throw mt::DataError(fmt::format("{}: not a JSON string", where));
      line = value.get<std::string>();
    }
    lines.push_back(std::move(line));
    if (lines.size() == batch_lines) flush();
  }
  flush();
}

// All of standard input's lines encoded in one batch, timed without the reading and printing, for
// bench/tokenizer_throughput.py: {"lines", "bytes", "tokens", "seconds"} on one line.
void benchmark(const mt::data::TextTokenizer& tokenizer, unsigned threads) {
  std::vector<std::string> lines;
  std::size_t bytes = 0;
  for (std::string line; std::getline(std::cin, line);) {
    bytes += line.size();
    lines.push_back(std::move(line));
  }
  const auto start = std::chrono::steady_clock::now();
  const auto ids = tokenizer.encode_batch(lines, threads);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
  std::size_t tokens = 0;
  for (const auto& row : ids) tokens += row.size();
  std::cout << nlohmann::json{{"lines", lines.size()},
                              {"bytes", bytes},
                              {"tokens", tokens},
                              {"seconds", seconds.count()}}
                   .dump()
            << '\n';
}

void decode_lines(const mt::data::TextTokenizer& tokenizer, bool json) {
  std::string line;
  for (std::size_t number = 1; std::getline(std::cin, line); ++number) {
    const auto where = fmt::format("standard input line {}", number);
    const auto value = mt::io::parse_json<mt::DataError>(line, where, "the line");  // bounded: depth, size
    std::vector<std::int32_t> ids;
    try {
      ids = value.get<std::vector<std::int32_t>>();
    } catch (const nlohmann::json::exception& e) {
      throw mt::DataError(fmt::format("{}: not a JSON array of ids ({})", where, e.what()));
    }
    const auto text = tokenizer.decode(ids);
    if (json)
      std::cout << nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    else
      std::cout << text << '\n';
  }
}

// Conversations, one a line, in the folder's chat template: their ids, or (`text_only`) the text.
void chat_lines(const mt::data::TextTokenizer& tokenizer, const std::filesystem::path& model_dir, bool text_only) {
  const auto chat = mt::data::ChatTemplate::from_folder(model_dir);
  if (!chat)
    throw mt::ConfigError(
        fmt::format("{}: holds no chat template (chat_template.jinja or tokenizer_config.json "
                    "'chat_template')",
                    model_dir.string()));
  const auto render = chat->for_training();
  std::string line;
  for (std::size_t number = 1; std::getline(std::cin, line); ++number) {
    const auto where = fmt::format("standard input line {}", number);
    auto record = mt::io::parse_ordered_json<mt::DataError>(line, where, "the line");  // bounded: depth, size
    if (record.is_array()) record = {{"messages", std::move(record)}};
    if (!record.is_object() || !record.contains("messages"))
      throw mt::DataError(fmt::format("{}: needs a 'messages' list (or to be one)", where));
    const auto text = mt::data::conversation_text(record, render, where);
    if (text_only)
      std::cout << nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    else
      std::cout << nlohmann::json(tokenizer.encode(text)).dump() << '\n';
  }
}

// The data set's token cache written (or found current), timed: {"cache", "written", "files",
// "documents", "tokens", "seconds"} on one line. A folder without a tokenizer gives the byte tokenizer.
void prepare(const std::string& model_dir, const std::string& data, const std::string& subset, unsigned threads) {
  const auto start = std::chrono::steady_clock::now();
  mt::data::CachedDataset dataset({.name = data, .subset = subset, .model = model_dir}, threads);
  bool written = false;
  const auto cached = dataset.open_or_build(&written);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
  std::cout << nlohmann::json{{"cache", dataset.cache_path().string()},
                              {"written", written},
                              {"files", cached.stats.files},
                              {"documents", cached.stats.documents},
                              {"tokens", cached.count},
                              {"seconds", seconds.count()}}
                   .dump()
            << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Encode text lines to token ids (or decode ids) with a model folder's tokenizer"};
  std::string model_dir;
  bool decode = false, verbose = false, json = false, time_only = false, chat = false, chat_text = false;
  unsigned threads = 0;
  app.add_option("model_dir", model_dir,
                 "folder holding tokenizer.json or tokenizer.model (with --prepare, a folder without either "
                 "means the byte tokenizer)")
      ->required();
  app.add_flag("--decode", decode, "read JSON arrays of ids, print their text");
  app.add_flag("--json", json, "texts are JSON strings (one a line), so they may hold newlines");
  app.add_flag("--chat", chat,
               "read conversations ({\"messages\": [...]} or a list of messages, one a line), print the ids of "
               "each in the folder's chat template");
  app.add_flag("--chat-text", chat_text, "as --chat, but print the rendered text as a JSON string");
  app.add_flag("--benchmark", time_only, "encode all input lines at once and print only the count and time, as JSON");
  std::string prepare_data, subset;
  app.add_option("--prepare", prepare_data,
                 "tokenise this data set (a file, folder or pattern, as -d takes) into its token cache and print "
                 "what was done as JSON");
  app.add_option("--dataset-subset", subset, "with --prepare: the subfolder of its folder to read");
  app.add_option("-t,--threads", threads, "encoding threads (0: one per core)")->capture_default_str();
  app.add_flag("-v,--verbose", verbose, "print which tokenizer was chosen, and its <bos>/<eos>, on standard error");
  CLI11_PARSE(app, argc, argv);
  try {
    std::ios::sync_with_stdio(false);
    if (!prepare_data.empty()) {
      prepare(model_dir, prepare_data, subset, threads);
      return 0;
    }
    std::string note;
    const auto tokenizer = mt::data::load_tokenizer(model_dir, &note);
    if (verbose) std::cerr << note << '\n';
    if (chat || chat_text)
      chat_lines(*tokenizer, model_dir, chat_text);
    else if (time_only)
      benchmark(*tokenizer, threads);
    else if (decode)
      decode_lines(*tokenizer, json);
    else
      encode_lines(*tokenizer, threads, json);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "meshtorch-tokenize: " << e.what() << '\n';
    return 1;
  }
}
