#pragma once
// Causal-LM datasets: documents (documents.hpp) are tokenised once, concatenated and cut into
// blocks of seq_length tokens, dropping the remainder (the guide's group_texts).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <meshtorch/torch.hpp>

// Only load_dataset needs it, but the umbrella header offers documents.hpp (and data_files.hpp)
// through this header.
#include <meshtorch/data/documents.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

// The ids cut into blocks of seq_length, the remainder dropped (and counted). Over a 1-D int32 (or,
// from a token cache, uint16) tensor that may map a token cache file: the blocks are a view, never
// a copy.
class TokenBlocks {
 public:
  struct IdRange {
    std::int32_t min_id, max_id;
  };

  MESHTORCH_DECL TokenBlocks(torch::Tensor tokens, std::int64_t seq_length, std::string source,
                             std::optional<IdRange> ids = {});
  TokenBlocks(const std::vector<std::int32_t>& tokens, std::int64_t seq_length, std::string source)
      : TokenBlocks(torch::from_blob(const_cast<std::int32_t*>(tokens.data()),
                                     {static_cast<std::int64_t>(tokens.size())}, torch::kInt)
                        .clone(),
                    seq_length, std::move(source)) {}

  std::int64_t size() const { return blocks_.size(0); }
  std::int64_t seq_length() const { return seq_length_; }
  const std::string& source() const { return source_; }
  // The ids after the last full block, which packing drops (fewer than seq_length).
  std::int64_t dropped_tokens() const { return dropped_tokens_; }

  // Rows `indices` as int64 token ids [indices.size(), seq_length]. A plain loop rather than
  // index_select: the loader calls this from its own thread, and an ATen op there would start
  // a second team of intra-op threads competing with the training step's.
  MESHTORCH_DECL torch::Tensor gather(const std::vector<std::int64_t>& indices) const;

  // Checks every token against the model's vocabulary once, not per batch (from the range the
  // token cache recorded when there is one: a cached start does not read the whole file).
  MESHTORCH_DECL void check_vocab(std::int64_t vocab_size) const;

  // --eval-split: the last `fraction` of the blocks (rounded, at least one) set apart for
  // evaluation, and these blocks cut to the rest. The last ones, whatever the seed or the number of
  // ranks, so that training and meshtorch-eval-loss agree on them; a document the boundary cuts
  // lends its start to training and its end to evaluation. A DataError when no block would be left
  // on either side. Both stay views of the same tokens. Returns held_out().
  MESHTORCH_DECL const TokenBlocks& hold_out(double fraction);
  // The blocks hold_out set apart, or nothing.
  const TokenBlocks* held_out() const { return held_out_.get(); }

 private:
  torch::Tensor blocks_;
  std::int64_t seq_length_;
  std::string source_;
  std::optional<IdRange> ids_;
  std::int64_t dropped_tokens_ = 0;
  std::shared_ptr<const TokenBlocks> held_out_;
};

// `-d builtin` or files (data_files.hpp) read whole into memory with the byte tokenizer; training
// runs go through the token cache instead (dataset_tokenizer.hpp).
MESHTORCH_DECL TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length);

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <cmath>
#include <span>

#include <fmt/format.h>

#include <meshtorch/data/builtin_corpus.hpp>
#include <meshtorch/data/tokenizer.hpp>

namespace meshtorch::data {

MESHTORCH_DECL TokenBlocks::TokenBlocks(torch::Tensor tokens, std::int64_t seq_length, std::string source,
                                        std::optional<IdRange> ids)
    : seq_length_(seq_length), source_(std::move(source)), ids_(ids) {
  if (seq_length <= 0) throw ConfigError("-s/--seq-length must be positive");
  const auto count = tokens.numel() / seq_length;
  if (count == 0)
    throw DataError(fmt::format("{}: {} tokens do not fill one block of {}", source_, tokens.numel(), seq_length));
  blocks_ = tokens.narrow(0, 0, count * seq_length).view({count, seq_length});
  dropped_tokens_ = tokens.numel() - count * seq_length;
}

MESHTORCH_DECL torch::Tensor TokenBlocks::gather(const std::vector<std::int64_t>& indices) const {
  auto rows = torch::empty({static_cast<std::int64_t>(indices.size()), seq_length_}, torch::kLong);
  auto copy_rows = [&](const auto* tokens) {
    auto* out = rows.data_ptr<std::int64_t>();
    for (const auto row : indices) {
      if (row < 0 || row >= size()) throw DataError(fmt::format("{}: block {} requested of {}", source_, row, size()));
      const auto* first = out;
      out = std::copy_n(tokens + row * seq_length_, seq_length_, out);
      // check_vocab took the range a token cache's footer records; an id outside it would reach
      // the embedding unchecked. Checking the rows a step reads costs far less than the step.
      if (ids_)
        for (const auto* id = first; id != out; ++id)
          if (*id < ids_->min_id || *id > ids_->max_id)
            throw DataError(fmt::format(
                "{}: block {} holds the id {}, outside the range {} to {} its token cache records (a damaged "
                "cache file: delete it to tokenise the data again)",
                source_, row, *id, ids_->min_id, ids_->max_id));
    }
  };
  // uint16 ids come from a token cache of a vocabulary that fits 16 bits; int32 otherwise.
  if (blocks_.scalar_type() == torch::kUInt16)
    copy_rows(static_cast<const std::uint16_t*>(blocks_.const_data_ptr()));
  else
    copy_rows(blocks_.const_data_ptr<std::int32_t>());
  return rows;
}

MESHTORCH_DECL void TokenBlocks::check_vocab(std::int64_t vocab_size) const {
  const std::int64_t min_id = ids_ ? ids_->min_id : blocks_.min().item<std::int64_t>();
  const std::int64_t max_id = ids_ ? ids_->max_id : blocks_.max().item<std::int64_t>();
  if (min_id < 0 || max_id >= vocab_size)
    throw DataError(fmt::format("{}: token id {} lies outside the model's vocab_size {}", source_,
                                min_id < 0 ? min_id : max_id, vocab_size));
}

MESHTORCH_DECL const TokenBlocks& TokenBlocks::hold_out(double fraction) {
  if (!(fraction > 0 && fraction < 1))
    throw ConfigError(
        fmt::format("--eval-split {}: give the fraction of blocks held out, above 0 and below 1", fraction));
  if (held_out_) throw ConfigError(fmt::format("{}: blocks are already held out for evaluation", source_));
  const auto held = std::max<std::int64_t>(1, std::llround(fraction * static_cast<double>(size())));
  if (held >= size())
    throw DataError(fmt::format("--eval-split {}: {} has {} block(s) of {} tokens, which would leave none to train on",
                                fraction, source_, size(), seq_length_));
  auto tail = std::make_shared<TokenBlocks>(*this);
  tail->blocks_ = blocks_.narrow(0, size() - held, held);
  tail->source_ = fmt::format("{} (held out)", source_);
  tail->dropped_tokens_ = 0;
  blocks_ = blocks_.narrow(0, 0, size() - held);
  held_out_ = std::move(tail);
  return *held_out_;
}

MESHTORCH_DECL TokenBlocks load_dataset(const std::string& name, std::int64_t seq_length) {
  std::vector<std::int32_t> tokens;
  if (name == "builtin") {
    ByteTokenizer tokenizer;
    for (const auto& doc : builtin_corpus()) tokenizer.encode_document(doc, tokens);
  } else {
    tokenize_files(resolve_data_files(name), byte_encoder(),
                   [&](std::span<const std::int32_t> ids) { tokens.insert(tokens.end(), ids.begin(), ids.end()); });
  }
  return TokenBlocks(tokens, seq_length, name);
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(core)
