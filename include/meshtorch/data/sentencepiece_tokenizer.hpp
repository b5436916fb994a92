#pragma once
// A tokenizer.model (Llama 2 style SentencePiece) through libsentencepiece itself, so ids are the
// `sentencepiece` package's. <bos>/<eos> default to the model's own and may be replaced from
// tokenizer_config.json by load_tokenizer (folder_tokenizer.hpp).
//
// Link requirement: libsentencepiece (CMake target meshtorch::tokenizers).
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/data/text_tokenizer.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace sentencepiece {
class SentencePieceProcessor;  // <sentencepiece_processor.h>, which only the definitions below include
}  // namespace sentencepiece

namespace meshtorch::data {

class SentencePieceTokenizer final : public TextTokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& path);

  std::vector<std::int32_t> encode(std::string_view text) const override;

  // SentencePiece's own decoding: control tokens (<s>, </s>) decode to nothing.
  std::string decode(std::span<const std::int32_t> ids) const override;

  std::int64_t vocab_size() const override;

  std::optional<std::int32_t> token_to_id(std::string_view token) const override;

  std::string describe() const override;

 private:
  std::string source_;
  std::shared_ptr<sentencepiece::SentencePieceProcessor> processor_;  // Encode/Decode are const and thread-safe
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#include <fmt/format.h>
#include <sentencepiece_processor.h>

namespace meshtorch::data {

MESHTORCH_DECL SentencePieceTokenizer::SentencePieceTokenizer(const std::filesystem::path& path)
    : source_(path.string()), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  if (!std::filesystem::is_regular_file(path)) throw DataError(fmt::format("{}: cannot open", source_));
  if (const auto status = processor_->Load(source_); !status.ok())
    throw DataError(fmt::format("{}: not a SentencePiece model ({})", source_, status.ToString()));
  if (processor_->bos_id() >= 0) bos_id = processor_->bos_id();
  if (processor_->eos_id() >= 0) eos_id = processor_->eos_id();
}

MESHTORCH_DECL std::vector<std::int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  if (const auto status = processor_->Encode(text, &ids); !status.ok())
    throw DataError(fmt::format("{}: cannot encode the text ({})", source_, status.ToString()));
  return {ids.begin(), ids.end()};
}

MESHTORCH_DECL std::string SentencePieceTokenizer::decode(std::span<const std::int32_t> ids) const {
  std::vector<int> plain;
  plain.reserve(ids.size());
  for (const auto id : ids) {
    if (id < 0 || id >= processor_->GetPieceSize())
      throw DataError(fmt::format("{}: token id {} is not in the vocabulary", source_, id));
    plain.push_back(id);
  }
  std::string text;
  if (const auto status = processor_->Decode(plain, &text); !status.ok())
    throw DataError(fmt::format("{}: cannot decode ({})", source_, status.ToString()));
  return text;
}

MESHTORCH_DECL std::int64_t SentencePieceTokenizer::vocab_size() const { return processor_->GetPieceSize(); }

MESHTORCH_DECL std::optional<std::int32_t> SentencePieceTokenizer::token_to_id(std::string_view token) const {
  const int id = processor_->PieceToId(token);
  // PieceToId answers unk_id for an unknown piece; only the unk piece itself may map there.
  if (processor_->IsUnknown(id) && processor_->IdToPiece(id) != token) return std::nullopt;
  return id;
}

MESHTORCH_DECL std::string SentencePieceTokenizer::describe() const {
  return fmt::format("SentencePiece ({}, {} pieces)", source_, vocab_size());
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
