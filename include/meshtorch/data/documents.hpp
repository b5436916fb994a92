#pragma once
// A data set's documents, read as a stream: plain text (documents separated by blank lines),
// JSONL (a "text" field, alpaca-style instruction/input/output in alpaca's template, or a
// conversation's "messages" in the model folder's chat template), or pre-tokenised llm.c .bin
// files (uint16 ids), over the files data_files.hpp resolves, tokenised a batch at a time so that
// neither the text nor its ids need to sit in memory whole. No LibTorch, and no Jinja: a chat
// template comes in as a ChatRenderer (chat_template.hpp makes one).
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json_fwd.hpp>

#include <meshtorch/data/data_files.hpp>
#include <meshtorch/data/tokenizer.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/json_file.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

// The same wording as the alpaca data set's own "text" field.
inline std::string format_alpaca(const std::string& instruction, const std::string& input, const std::string& output) {
  if (input.empty())
    return "Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\n\n### Instruction:\n" +
           instruction + "\n\n### Response:\n" + output;
  return "Below is an instruction that describes a task, paired with an input that provides further context. Write "
         "a response that appropriately completes the request.\n\n### Instruction:\n" +
         instruction + "\n\n### Input:\n" + input + "\n\n### Response:\n" + output;
}

// What reading a data set counted; kept in the token cache, so that a cached start logs the same line.
struct TokenStreamStats {
  std::uint64_t files = 0;
  std::uint64_t documents = 0;
  std::uint64_t skipped_lines = 0;  // blank JSONL lines: nothing to train on, but counted and logged
};

// Documents as the tokenizer receives them, a batch at a time: each text, and whether a chat
// template wrote it. A template writes its own special tokens (<bos>, end-of-turn), so its ids are
// kept as encoded, as transformers' apply_chat_template(tokenize=True) gives them; any other
// document is framed as [<bos>] ids <eos>.
struct DocumentBatch {
  std::vector<std::string> texts;
  std::vector<std::uint8_t> from_chat_template;  // one flag per text
  std::size_t bytes = 0;

  void add(std::string&& text, bool chat) {
    bytes += text.size();
    texts.push_back(std::move(text));
    from_chat_template.push_back(chat ? 1 : 0);
  }
  bool empty() const { return texts.empty(); }
  void clear() {
    texts.clear();
    from_chat_template.clear();
    bytes = 0;
  }
};

// A conversation's text: (messages, tools or null, where) -> the chat template's rendering. `where`
// is the data file and line, for the template's errors.
using ChatRenderer =
    std::function<std::string(const nlohmann::ordered_json&, const nlohmann::ordered_json&, const std::string&)>;

// Each document of a text file (documents separated by blank lines) to `sink(std::string&&, false)`.
template <class Sink>
void for_each_text_document(const std::filesystem::path& path, Sink&& sink, TokenStreamStats& stats) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  std::string line, current;
  auto emit = [&] {
    if (current.empty()) return;
    ++stats.documents;
    sink(std::move(current), false);
    current.clear();
  };
  while (std::getline(in, line)) {
    if (line.empty()) {
      emit();
    } else {
      if (!current.empty()) current += '\n';
      current += line;
    }
  }
  emit();
  ++stats.files;
}

// A conversation record: "messages" a non-empty list of objects with a string "role" and a
// "content" that is a string, a list (typed parts) or null; "tools", if there, a list.
MESHTORCH_DECL void check_conversation(const nlohmann::ordered_json& record, const std::string& where);

// A conversation record ({"messages": [...], "tools": [...]}) checked and written with `chat`.
MESHTORCH_DECL std::string conversation_text(const nlohmann::ordered_json& record, const ChatRenderer& chat,
                                             const std::string& where);

// A document as a reader hands it on: its text, and whether a chat template wrote it.
using DocumentSink = std::function<void(std::string&&, bool from_chat_template)>;

// Each record of a JSONL file: its "text", an alpaca record (instruction/input/output) in the
// alpaca template, or a conversation ("messages", and "tools" if any) in `chat`'s template, to
// `sink`. A malformed line is an error naming file and line; a blank one is counted.
MESHTORCH_DECL void for_each_jsonl_document(const std::filesystem::path& path, const DocumentSink& sink,
                                            TokenStreamStats& stats, const ChatRenderer& chat = {});

// llm.c's token file: a 256 x int32 header (magic 20240520, version 1, token count), then uint16
// tokens. The header is checked against the file's size before the tokens are allocated.
inline std::vector<std::int32_t> read_llmc_tokens(const std::filesystem::path& path) {
  const std::string where = path.string();
  constexpr std::int32_t magic = 20240520;
  constexpr std::uint64_t header_bytes = 256 * sizeof(std::int32_t);
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) throw DataError(fmt::format("{}: not a regular file", where));
  const std::uint64_t file_size = std::filesystem::file_size(path, error);
  if (error) throw DataError(fmt::format("{}: cannot read its size ({})", where, error.message()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{}: cannot open", where));
  std::int32_t header[256] = {};
  in.read(reinterpret_cast<char*>(header), static_cast<std::streamsize>(std::min(file_size, header_bytes)));
  if (!in) throw DataError(fmt::format("{}: the header could not be read", where));
  // Another format is named as such; a cut-off llm.c file (right magic number) as truncated.
  if (file_size < sizeof(std::int32_t) || header[0] != magic)
    throw DataError(fmt::format("{}: not an llm.c token file (magic number {}, expected {})", where,
                                file_size < sizeof(std::int32_t) ? std::string("missing") : std::to_string(header[0]),
                                magic));
  if (file_size < header_bytes)
    throw DataError(fmt::format("{}: {} bytes, shorter than the {}-byte header of an llm.c token file (truncated?)",
                                where, file_size, header_bytes));
  if (header[1] != 1) throw DataError(fmt::format("{}: unsupported llm.c token file version {}", where, header[1]));
  if (header[2] < 0) throw DataError(fmt::format("{}: the header's token count is negative ({})", where, header[2]));
  const auto count = static_cast<std::uint64_t>(header[2]);
  const std::uint64_t token_bytes = file_size - header_bytes;
  if (count * sizeof(std::uint16_t) > token_bytes)
    throw DataError(
        fmt::format("{}: the header says {} tokens ({} bytes) but the file holds {} bytes after the "
                    "header (truncated?)",
                    where, count, count * sizeof(std::uint16_t), token_bytes));
  std::vector<std::uint16_t> raw(count);
  in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(count * sizeof(std::uint16_t)));
  if (!in) throw DataError(fmt::format("{}: {} tokens could not be read", where, count));
  return {raw.begin(), raw.end()};
}

// Appends each document of a batch, in order, as the tokenizer frames it (see DocumentBatch).
using DocumentEncoder = std::function<void(const DocumentBatch&, std::vector<std::int32_t>&)>;

inline DocumentEncoder byte_encoder() {
  return [](const DocumentBatch& batch, std::vector<std::int32_t>& out) {
    const ByteTokenizer tokenizer;
    for (const auto& document : batch.texts) tokenizer.encode_document(document, out);
  };
}

// Every file's ids in order, handed to `sink(std::span<const std::int32_t>)` a batch of about
// `batch_bytes` of text at a time, so that neither the text nor its ids sit in memory whole.
// llm.c .bin files give their own ids; conversations are written with `chat`.
template <class Sink>
TokenStreamStats tokenize_files(const DataFiles& data, const DocumentEncoder& encode, Sink&& sink,
                                const ChatRenderer& chat = {}, std::size_t batch_bytes = std::size_t{32} << 20) {
  TokenStreamStats stats;
  DocumentBatch batch;
  std::vector<std::int32_t> ids;
  auto flush = [&] {
    if (batch.empty()) return;
    ids.clear();
    encode(batch, ids);
    sink(std::span<const std::int32_t>(ids));
    batch.clear();
  };
  auto add = [&](std::string&& document, bool from_chat_template) {
    batch.add(std::move(document), from_chat_template);
    if (batch.bytes >= batch_bytes) flush();
  };
  for (const auto& file : data.files) {
    if (data.tokenized) {
      const auto tokens = read_llmc_tokens(file);
      sink(std::span<const std::int32_t>(tokens));
      ++stats.files;
    } else if (data_format_of(file) == DataFormat::jsonl) {
      for_each_jsonl_document(file, add, stats, chat);
    } else {
      for_each_text_document(file, add, stats);
    }
  }
  flush();
  return stats;
}

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(core)
#include <nlohmann/json.hpp>

namespace meshtorch::data {

MESHTORCH_DECL void check_conversation(const nlohmann::ordered_json& record, const std::string& where) {
  const auto& messages = record["messages"];
  if (!messages.is_array() || messages.empty())
    throw DataError(fmt::format("{}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects", where));
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& message = messages[i];
    if (!message.is_object() || !message.contains("role") || !message["role"].is_string())
      throw DataError(fmt::format("{}: messages[{}] needs a string 'role'", where, i));
    if (message.contains("content") && !message["content"].is_string() && !message["content"].is_array() &&
        !message["content"].is_null())
      throw DataError(fmt::format("{}: messages[{}] 'content' must be a string, a list or null", where, i));
  }
  if (record.contains("tools") && !record["tools"].is_array() && !record["tools"].is_null())
    throw DataError(fmt::format("{}: 'tools' must be a list of tool schemas", where));
}

MESHTORCH_DECL std::string conversation_text(const nlohmann::ordered_json& record, const ChatRenderer& chat,
                                             const std::string& where) {
  check_conversation(record, where);
  if (!chat)
    throw DataError(
        fmt::format("{}: a conversation ('messages') is written in the model's chat template, and "
                    "there is none: -m must name a model folder with chat_template.jinja or "
                    "tokenizer_config.json 'chat_template'",
                    where));
  return chat(record["messages"], record.contains("tools") ? record["tools"] : nlohmann::ordered_json(), where);
}

MESHTORCH_DECL void for_each_jsonl_document(const std::filesystem::path& path, const DocumentSink& sink,
                                            TokenStreamStats& stats, const ChatRenderer& chat) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      ++stats.skipped_lines;
      continue;
    }
    const std::string where = fmt::format("{}:{}", path.string(), number);
    // Ordered, so that a template's tojson writes a message's fields in the file's order, as Python does.
    // Bounded as every JSON file is (io/json_file.hpp): 1e999 threw a raw nlohmann error, a
    // repeated key was taken silently, and a deep value reached the checks.
    const auto record = io::parse_ordered_json<DataError>(line, where, "the line");
    auto string_field = [&](const char* name) -> std::string {
      auto it = record.find(name);
      if (it == record.end() || it->is_null()) return {};
      if (!it->is_string()) throw DataError(fmt::format("{}: field '{}' must be a string", where, name));
      return it->get<std::string>();
    };
    if (!record.is_object()) throw DataError(fmt::format("{}: each line must be a JSON object", where));
    ++stats.documents;
    if (record.contains("text")) {
      sink(string_field("text"), false);
    } else if (record.contains("instruction") && record.contains("output")) {
      sink(format_alpaca(string_field("instruction"), string_field("input"), string_field("output")), false);
    } else if (record.contains("messages")) {
      sink(conversation_text(record, chat, where), true);
    } else {
      throw DataError(fmt::format("{}: needs a 'text' field, 'instruction' and 'output' fields, or 'messages'", where));
    }
  }
  ++stats.files;
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(core)
