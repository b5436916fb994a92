#pragma once
// Causal-LM datasets: documents are tokenised once, concatenated and cut into blocks of
// seq_length tokens, dropping the remainder (the guide's group_texts). Sources: `builtin`, a
// plain-text file (documents separated by blank lines), a JSONL file (a "text" field, or
// alpaca-style instruction/input/output), or a pre-tokenised llm.c .bin file (uint16 tokens).
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <meshtorch/data/builtin_corpus.hpp>
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

inline std::vector<std::string> read_text_documents(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  std::vector<std::string> documents;
  std::string line, current;
  while (std::getline(in, line)) {
    if (line.empty()) {
      if (!current.empty()) documents.push_back(std::move(current));
      current.clear();
    } else {
      if (!current.empty()) current += '\n';
      current += line;
    }
  }
  if (!current.empty()) documents.push_back(std::move(current));
  return documents;
}

inline std::vector<std::string> read_jsonl_documents(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot open", path.string()));
  std::vector<std::string> documents;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path.string() + ":" + std::to_string(number);
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
    if (record.contains("text")) {
      documents.push_back(string_field("text"));
    } else if (record.contains("instruction") && record.contains("output")) {
      documents.push_back(format_alpaca(string_field("instruction"), string_field("input"), string_field("output")));
    } else {
      throw DataError(fmt::format("{}: needs a 'text' field or 'instruction' and 'output' fields", where));
    }
  }
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

class TokenBlocks {
 public:
  TokenBlocks(const std::vector<std::int32_t>& tokens, std::int64_t seq_length, std::string source)
      : seq_length_(seq_length), source_(std::move(source)) {
    if (seq_length <= 0) throw ConfigError("-s/--seq-length must be positive");
    const auto count = static_cast<std::int64_t>(tokens.size()) / seq_length;
    if (count == 0)
      throw DataError(fmt::format("{}: {} tokens do not fill one block of {}", source_, tokens.size(), seq_length));
    blocks_ = torch::from_blob(const_cast<std::int32_t*>(tokens.data()), {count, seq_length}, torch::kInt).clone();
  }

  std::int64_t size() const { return blocks_.size(0); }
  std::int64_t seq_length() const { return seq_length_; }
  const std::string& source() const { return source_; }

  // Rows `indices` as int64 token ids [indices.size(), seq_length]. A plain loop rather than
  // index_select: the loader calls this from its own thread, and an ATen op there would start
  // a second team of intra-op threads competing with the training step's.
  torch::Tensor gather(const std::vector<std::int64_t>& indices) const {
    auto rows = torch::empty({static_cast<std::int64_t>(indices.size()), seq_length_}, torch::kLong);
    auto* out = rows.data_ptr<std::int64_t>();
    const auto* tokens = blocks_.data_ptr<std::int32_t>();
    for (const auto row : indices) {
      if (row < 0 || row >= size())
        throw DataError(fmt::format("{}: block {} requested of {}", source_, row, size()));
      out = std::copy_n(tokens + row * seq_length_, seq_length_, out);
    }
    return rows;
  }

  // Checks every token against the model's vocabulary once, not per batch.
  void check_vocab(std::int64_t vocab_size) const {
    const auto max_id = blocks_.max().item<std::int64_t>();
    const auto min_id = blocks_.min().item<std::int64_t>();
    if (min_id < 0 || max_id >= vocab_size)
      throw DataError(fmt::format("{}: token id {} lies outside the model's vocab_size {}", source_,
                                  min_id < 0 ? min_id : max_id, vocab_size));
  }

 private:
  torch::Tensor blocks_;
  std::int64_t seq_length_;
  std::string source_;
};

// `-d builtin` or a path; the file's extension chooses the format.
inline TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length) {
  ByteTokenizer tokenizer;
  std::vector<std::int32_t> tokens;
  std::vector<std::string> documents;
  if (name == "builtin") {
    documents = builtin_corpus();
  } else {
    const std::filesystem::path path(name);
    if (!std::filesystem::exists(path))
      throw DataError(fmt::format("-d/--dataset-name '{}' is neither 'builtin' nor an existing file", name));
    if (!std::filesystem::is_regular_file(path))
      throw DataError(fmt::format("-d/--dataset-name '{}' is not a regular file (a directory, device or pipe)", name));
    const auto ext = path.extension().string();
    if (ext == ".jsonl" || ext == ".json")
      documents = read_jsonl_documents(path);
    else if (ext == ".bin")
      tokens = read_llmc_tokens(path);
    else
      documents = read_text_documents(path);
  }
  for (const auto& doc : documents) tokenizer.encode_document(doc, tokens);
  return TokenBlocks(tokens, seq_length, name);
}

}  // namespace meshtorch::data
