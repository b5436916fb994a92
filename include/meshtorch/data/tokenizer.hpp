#pragma once
// A byte-level tokenizer: token b is byte b, then <bos> and <eos>. It serves the built-in
// corpus and plain files without any vocabulary file; real tokenizers come with model folders.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::data {

class ByteTokenizer {
 public:
  static constexpr std::int64_t bos_id = 256;
  static constexpr std::int64_t eos_id = 257;
  static constexpr std::int64_t min_vocab_size = 258;

  // Appends <bos> text-bytes <eos>, the document boundary that packing keeps.
  void encode_document(std::string_view text, std::vector<std::int32_t>& out) const {
    out.push_back(static_cast<std::int32_t>(bos_id));
    for (unsigned char byte : text) out.push_back(byte);
    out.push_back(static_cast<std::int32_t>(eos_id));
  }

  std::string decode(const std::vector<std::int64_t>& ids) const {
    std::string text;
    for (auto id : ids)
      if (id >= 0 && id < 256) text.push_back(static_cast<char>(id));
    return text;
  }

  static void check_vocab(std::int64_t vocab_size) {
    if (vocab_size < min_vocab_size)
      throw ConfigError(
          fmt::format("the byte tokenizer needs vocab_size >= {}, the model has {}", min_vocab_size, vocab_size));
  }
};

}  // namespace meshtorch::data
