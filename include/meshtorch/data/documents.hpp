#pragma once
// A data set's documents, read as a stream: plain text (documents separated by blank lines),
// JSONL (a "text" field, or alpaca-style instruction/input/output in alpaca's template), or
// pre-tokenised llm.c .bin files (uint16 ids), over the files data_files.hpp resolves, tokenised
// a batch at a time so that neither the text nor its ids need to sit in memory whole. No LibTorch.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/data/data_files.hpp>
#include <meshtorch/data/tokenizer.hpp>
#include <meshtorch/error.hpp>

namespace meshtorch::data {

// The same wording as the alpaca data set's own "text" field.
inline std::string format_alpaca(const std::string& instruction, const std::string& input, const std::string& output) {
  if (input.empty())
    return "Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\n\n### Instruction:\n" + instruction + "\n\n### Response:\n" + output;
  return "Below is an instruction that describes a task, paired with an input that provides further context. Write "
         "a response that appropriately completes the request.\n\n### Instruction:\n" + instruction +
         "\n\n### Input:\n" + input + "\n\n### Response:\n" + output;
}

// What reading a data set counted; kept in the token cache, so that a cached start logs the same line.
struct TokenStreamStats {
  std::uint64_t files = 0;
  std::uint64_t documents = 0;
  std::uint64_t skipped_lines = 0;  // blank JSONL lines: nothing to train on, but counted and logged
};

// Each document of a text file (documents separated by blank lines) to `sink(std::string&&)`.
template <class Sink>
void for_each_text_document(const std::filesystem::path& path, Sink&& sink, TokenStreamStats& stats) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  std::string line, current;
  auto emit = [&] {
    if (current.empty()) return;
    ++stats.documents;
    sink(std::move(current));
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

// Each record of a JSONL file: its "text", or an alpaca record (instruction/input/output) in the
// alpaca template. A malformed line is an error naming file and line; a blank one is counted.
template <class Sink>
void for_each_jsonl_document(const std::filesystem::path& path, Sink&& sink, TokenStreamStats& stats) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      ++stats.skipped_lines;
      continue;
    }
    const std::string where = fmt::format("{}:{}", path.string(), number);
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw DataError(fmt::format("{}: not valid JSON ({})", where, e.what()));
    }
    auto string_field = [&](const char* name) -> std::string {
      auto it = record.find(name);
      if (it == record.end() || it->is_null()) return {};
      if (!it->is_string()) throw DataError(fmt::format("{}: field '{}' must be a string", where, name));
      return it->get<std::string>();
    };
    if (!record.is_object()) throw DataError(fmt::format("{}: each line must be a JSON object", where));
    ++stats.documents;
    if (record.contains("text")) {
      sink(string_field("text"));
    } else if (record.contains("instruction") && record.contains("output")) {
      sink(format_alpaca(string_field("instruction"), string_field("input"), string_field("output")));
    } else {
      throw DataError(fmt::format("{}: needs a 'text' field or 'instruction' and 'output' fields", where));
    }
  }
  ++stats.files;
}

inline std::vector<std::string> read_text_documents(const std::filesystem::path& path) {
  std::vector<std::string> documents;
  TokenStreamStats stats;
  for_each_text_document(path, [&](std::string&& document) { documents.push_back(std::move(document)); }, stats);
  return documents;
}

inline std::vector<std::string> read_jsonl_documents(const std::filesystem::path& path) {
  std::vector<std::string> documents;
  TokenStreamStats stats;
  for_each_jsonl_document(path, [&](std::string&& document) { documents.push_back(std::move(document)); }, stats);
  return documents;
}

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
  if (header[2] < 0)
    throw DataError(fmt::format("{}: the header's token count is negative ({})", where, header[2]));
  const auto count = static_cast<std::uint64_t>(header[2]);
  const std::uint64_t token_bytes = file_size - header_bytes;
  if (count * sizeof(std::uint16_t) > token_bytes)
    throw DataError(fmt::format("{}: the header says {} tokens ({} bytes) but the file holds {} bytes after the "
                                "header (truncated?)",
                                where, count, count * sizeof(std::uint16_t), token_bytes));
  std::vector<std::uint16_t> raw(count);
  in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(count * sizeof(std::uint16_t)));
  if (!in) throw DataError(fmt::format("{}: {} tokens could not be read", where, count));
  return {raw.begin(), raw.end()};
}

// Appends each document of a batch, in order, as the tokenizer frames it ([<bos>] ids <eos>).
using DocumentEncoder = std::function<void(std::span<const std::string>, std::vector<std::int32_t>&)>;

inline DocumentEncoder byte_encoder() {
  return [](std::span<const std::string> documents, std::vector<std::int32_t>& out) {
    const ByteTokenizer tokenizer;
    for (const auto& document : documents) tokenizer.encode_document(document, out);
  };
}

// Every file's ids in order, handed to `sink(std::span<const std::int32_t>)` a batch of about
// `batch_bytes` of text at a time, so that neither the text nor its ids sit in memory whole.
// llm.c .bin files give their own ids.
template <class Sink>
TokenStreamStats tokenize_files(const DataFiles& data, const DocumentEncoder& encode, Sink&& sink,
                                std::size_t batch_bytes = std::size_t{32} << 20) {
  TokenStreamStats stats;
  std::vector<std::string> batch;
  std::vector<std::int32_t> ids;
  std::size_t bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    ids.clear();
    encode(batch, ids);
    sink(std::span<const std::int32_t>(ids));
    batch.clear();
    bytes = 0;
  };
  auto add = [&](std::string&& document) {
    bytes += document.size();
    batch.push_back(std::move(document));
    if (bytes >= batch_bytes) flush();
  };
  for (const auto& file : data.files) {
    if (data.tokenized) {
      const auto tokens = read_llmc_tokens(file);
      sink(std::span<const std::int32_t>(tokens));
      ++stats.files;
    } else if (data_format_of(file) == DataFormat::jsonl) {
      for_each_jsonl_document(file, add, stats);
    } else {
      for_each_text_document(file, add, stats);
    }
  }
  flush();
  return stats;
}

}  // namespace meshtorch::data
