#pragma once
// What every tokenizer of a model folder offers (tokenizer.json's byte-level BPE, tokenizer.model's
// SentencePiece): text -> ids, ids -> text, the document boundary tokens, and batch encoding on
// several threads. No LibTorch here, and no regex or SentencePiece library either: those are the
// implementations' link requirements, not the interface's.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;

  // The ids of `text` without any added <bos>/<eos> (HF's add_special_tokens=False); special
  // tokens written in the text are recognised as such.
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // The text of `ids`, special tokens included, so decode(encode(x)) == x.
  virtual std::string decode(std::span<const std::int32_t> ids) const = 0;
  // One more than the largest id the tokenizer can produce.
  virtual std::int64_t vocab_size() const = 0;
  virtual std::optional<std::int32_t> token_to_id(std::string_view token) const = 0;
  // "byte-level BPE (tokenizer.json, 1234 tokens)": what a log line names.
  virtual std::string describe() const = 0;

  // The document boundaries that packing keeps; set from tokenizer_config.json or
  // generation_config.json by load_tokenizer (folder_tokenizer.hpp).
  std::optional<std::int32_t> bos_id;
  std::optional<std::int32_t> eos_id;

  // The special tokens HF's encode adds around a text by default (add_special_tokens=True): those
  // of tokenizer.json's post-processor template (Llama 3's <|begin_of_text|>), or <bos> for a
  // SentencePiece model; set by the tokenizer and by load_tokenizer. What a prompt is encoded with.
  std::vector<std::int32_t> added_before, added_after;
  MESHTORCH_DECL std::vector<std::int32_t> encode_with_special_tokens(std::string_view text) const;

  // Appends [<bos>] ids <eos>, as the byte tokenizer does for the built-in corpus.
  MESHTORCH_DECL void encode_document(std::string_view text, std::vector<std::int32_t>& out) const;

  // Each text's ids, in order, computed on `threads` threads (0: one per core).
  MESHTORCH_DECL std::vector<std::vector<std::int32_t>> encode_batch(std::span<const std::string> texts,
                                                                     unsigned threads = 0) const;

  // The documents encoded on `threads` threads and concatenated in order, each as [<bos>] ids <eos>
  // except those flagged in `from_chat_template` (one flag per document, or none): a chat
  // template wrote their special tokens, so their ids stay as encoded.
  MESHTORCH_DECL std::vector<std::int32_t> encode_documents(
      std::span<const std::string> documents, unsigned threads = 0,
      std::span<const std::uint8_t> from_chat_template = {}) const;

 protected:
  // What one thread keeps between the texts it encodes (a word cache, regex match data); the
  // default keeps nothing.
  struct Session {
    virtual ~Session() = default;
    virtual std::vector<std::int32_t> encode(std::string_view text) = 0;
  };
  MESHTORCH_DECL virtual std::unique_ptr<Session> start_session() const;

 private:
  MESHTORCH_DECL void append_document(const std::vector<std::int32_t>& ids, std::vector<std::int32_t>& out) const;

  // Each thread runs `work(next_range)`, where next_range() hands out the next chunk of indices
  // in order (an empty range at the end); the first exception of any thread is rethrown here.
  template <class Work>
  static void run_on_threads(std::size_t count, unsigned threads, const Work& work);
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::data {

// run_on_threads is a template used only by encode_batch, so it is defined here with it.
template <class Work>
void TextTokenizer::run_on_threads(std::size_t count, unsigned threads, const Work& work) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  constexpr std::size_t chunk = 16;
  const auto chunks = (count + chunk - 1) / chunk;
  threads = static_cast<unsigned>(std::min<std::size_t>(threads, chunks));
  std::atomic<std::size_t> next{0};
  auto next_range = [&] {
    const auto c = next.fetch_add(1);
    return c < chunks ? std::pair{c * chunk, std::min(count, (c + 1) * chunk)} : std::pair{count, count};
  };
  if (threads <= 1) {
    work(next_range);
    return;
  }
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto body = [&] {
    try {
      work(next_range);
    } catch (...) {
      std::lock_guard lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next = chunks;
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(body);
  body();
  for (auto& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

MESHTORCH_DECL std::vector<std::int32_t> TextTokenizer::encode_with_special_tokens(std::string_view text) const {
  std::vector<std::int32_t> ids = added_before;
  const auto body = encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.insert(ids.end(), added_after.begin(), added_after.end());
  return ids;
}

MESHTORCH_DECL void TextTokenizer::encode_document(std::string_view text, std::vector<std::int32_t>& out) const {
  const auto ids = encode(text);
  append_document(ids, out);
}

MESHTORCH_DECL std::vector<std::vector<std::int32_t>> TextTokenizer::encode_batch(std::span<const std::string> texts,
                                                                                  unsigned threads) const {
  std::vector<std::vector<std::int32_t>> out(texts.size());
  run_on_threads(texts.size(), threads, [&](const auto& next_range) {
    const auto session = start_session();
    for (auto range = next_range(); range.first < range.second; range = next_range())
      for (auto i = range.first; i < range.second; ++i) out[i] = session->encode(texts[i]);
  });
  return out;
}

MESHTORCH_DECL std::vector<std::int32_t> TextTokenizer::encode_documents(
    std::span<const std::string> documents, unsigned threads, std::span<const std::uint8_t> from_chat_template) const {
  if (!from_chat_template.empty() && from_chat_template.size() != documents.size())
    throw std::invalid_argument(fmt::format("encode_documents: {} chat-template flags for {} documents",
                                            from_chat_template.size(), documents.size()));
  const auto batch = encode_batch(documents, threads);
  std::size_t total = 0;
  for (const auto& ids : batch) total += ids.size() + 2;
  std::vector<std::int32_t> out;
  out.reserve(total);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (!from_chat_template.empty() && from_chat_template[i])
      out.insert(out.end(), batch[i].begin(), batch[i].end());
    else
      append_document(batch[i], out);
  }
  return out;
}

MESHTORCH_DECL std::unique_ptr<TextTokenizer::Session> TextTokenizer::start_session() const {
  struct Stateless final : Session {
    explicit Stateless(const TextTokenizer& t) : tokenizer(t) {}
    std::vector<std::int32_t> encode(std::string_view text) override { return tokenizer.encode(text); }
    const TextTokenizer& tokenizer;
  };
  return std::make_unique<Stateless>(*this);
}

MESHTORCH_DECL void TextTokenizer::append_document(const std::vector<std::int32_t>& ids,
                                                   std::vector<std::int32_t>& out) const {
  if (!eos_id)
    throw ConfigError(
        fmt::format("{}: no end-of-text token is known (tokenizer_config.json 'eos_token' or "
                    "generation_config.json 'eos_token_id'), so documents cannot be packed with a "
                    "boundary",
                    describe()));
  if (bos_id) out.push_back(*bos_id);
  out.insert(out.end(), ids.begin(), ids.end());
  out.push_back(*eos_id);
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(programs)
