#pragma once
// HF `tokenizers`' byte-level BPE, read from a tokenizer.json (GPT-2, Llama 3 and their kin):
// added and special tokens split off first (leftmost-longest, as HF's AddedVocabulary), then the
// pre-tokenizer (Split steps by regex, e.g. Llama 3's pattern with Unicode categories, and the
// ByteLevel step, optionally with GPT-2's regex), then merges by rank within each piece.
// A setting that would change the ids and that this class does not implement (a normalizer,
// BPE dropout, byte fallback, a word suffix, single-word added tokens, another pre-tokenizer or
// decoder) is a ConfigError naming the field, never ignored.
//
// Link requirement: PCRE2 (libpcre2-8; CMake target meshtorch::tokenizers). The regexes are
// HF's, written for Oniguruma; PCRE2 with UTF and UCP gives them the same meaning (\p{L},
// \p{N}, \s over Unicode, (?i:...) with Unicode case folding).
#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/data/text_tokenizer.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/json_file.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

namespace bpe_detail {

// One compiled PCRE2 pattern (defined with the definitions below, which alone include PCRE2).
class Regex;

}  // namespace bpe_detail

class BpeTokenizer final : public TextTokenizer {
 public:
  struct AddedToken {
    std::int32_t id;
    std::string content;
    bool special;
    bool lstrip;
    bool rstrip;
    bool normalized;  // matched in a second pass, inside the text the first pass left (HF's order)
  };

  static BpeTokenizer from_file(const std::filesystem::path& path);

  BpeTokenizer(const nlohmann::json& j, std::string source);

  std::vector<std::int32_t> encode(std::string_view text) const override;

  std::string decode(std::span<const std::int32_t> ids) const override;

  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(id_bytes_.size()); }

  std::optional<std::int32_t> token_to_id(std::string_view token) const override;

  std::string describe() const override;

  const std::vector<AddedToken>& added_tokens() const { return added_; }

 protected:
  std::unique_ptr<Session> start_session() const override;

 private:
  enum class StepKind { split, byte_level };
  struct PreTokenizerStep {
    StepKind kind;
    std::shared_ptr<const bpe_detail::Regex> regex;  // split: the pattern; byte_level: GPT-2's or none
    bool add_prefix_space = false;
  };
  struct Merge {
    std::int32_t rank;
    std::int32_t merged;
  };
  // The symbols of one piece while merging: a doubly linked list over the piece's bytes.
  struct MergeScratch {
    std::vector<std::int32_t> id, prev, next;
    std::vector<std::pair<std::int64_t, std::int32_t>> heap;  // (rank << 32 | position, merged id), a min-heap
  };

  // One thread's scratch: regex match data and a cache of pieces already merged.
  class BpeSession;
  friend class BpeSession;

  std::string where(std::string_view field) const;

  static std::string type_of(const nlohmann::json& j);

  const nlohmann::json& field(const nlohmann::json& j, const std::string& name, const std::string& path = "") const;

  bool flag(const nlohmann::json& j, const std::string& name, bool fallback, const std::string& path) const;

  void read_model(const nlohmann::json& model);

  void read_pre_tokenizer(const nlohmann::json& pre);

  void read_decoder(const nlohmann::json& decoder);

  void read_added_tokens(const nlohmann::json& added);

  void resize_ids(std::int32_t count);
  void set_id(std::int32_t id, std::string bytes);

  // `id` of `what` (a JSON path and token) as an id below id_bound_, or an error naming both.
  std::int32_t checked_id(const nlohmann::json& id, const std::string& what) const;

  static std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) | static_cast<std::uint32_t>(right);
  }

  struct AddedMatch {
    std::size_t begin, end;  // what the token consumes, its lstrip/rstrip whitespace included
    std::int32_t id;
  };

  // The leftmost-longest added token of one pass at or after `start`, or begin == text.size().
  AddedMatch find_added(std::string_view text, std::size_t start, bool normalized) const;

  static std::size_t whitespace_before(std::string_view text, std::size_t pos);

  static std::size_t whitespace_after(std::string_view text, std::size_t pos);

  // Merges one piece's bytes by rank: always the lowest-ranked adjacent pair, the leftmost of equal
  // ones, as HF's Word::merge_all does (a heap over (rank, position) with lazy invalidation).
  void merge(std::string_view piece, std::vector<std::int32_t>& ids, MergeScratch& s) const;

  static std::string hex(unsigned char byte);

  std::string source_;
  std::unordered_map<std::string, std::int32_t> vocab_;           // as written: byte-level strings
  std::unordered_map<std::string, std::int32_t> vocab_by_bytes_;  // the same tokens as raw bytes
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::array<std::int32_t, 256> byte_id_{};
  std::optional<std::int32_t> unk_id_;
  bool ignore_merges_ = false;
  bool fuse_unk_ = false;
  std::vector<PreTokenizerStep> steps_;
  std::vector<AddedToken> added_;
  std::array<std::array<std::vector<std::size_t>, 256>, 2> added_by_first_byte_;  // [normalized][first byte]
  std::vector<std::string> id_bytes_;                                             // what decode writes for each id
  std::vector<bool> id_known_;
  // Ids index id_bytes_, so they are bounded by what the file defines before anything is
  // allocated: a 22 KB file with the id 300,000,000 would otherwise ask for 10 GB.
  static constexpr std::int64_t id_gap_allowance = 65536;
  std::int64_t id_bound_ = 0;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <pcre2.h>

namespace meshtorch::data {

namespace bpe_detail {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
// code points 256.. in order, so every byte string is a printable string in vocab files.
inline const std::array<char32_t, 256>& byte_to_code_point() {
  static const auto table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

inline void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// The code points of a UTF-8 string that is known to be valid (JSON strings are), or nothing.
inline std::optional<std::vector<char32_t>> code_points(std::string_view s) {
  std::vector<char32_t> out;
  for (std::size_t i = 0; i < s.size();) {
    const auto lead = static_cast<unsigned char>(s[i]);
    const int length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
    if (length == 0 || i + length > s.size()) return std::nullopt;
    char32_t cp = length == 1 ? lead : length == 2 ? (lead & 0x1F) : length == 3 ? (lead & 0x0F) : (lead & 0x07);
    for (int k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += length;
  }
  return out;
}

// A vocabulary entry as raw bytes: each code point mapped back through the byte table. An entry
// with a code point outside the table (an added token such as "<|eot_id|>" is inside it, but one
// with non-Latin letters is not) stands for its own UTF-8 bytes, as in HF's ByteLevel decoder.
inline std::string token_bytes(std::string_view token) {
  static const auto inverse = [] {
    std::unordered_map<char32_t, unsigned char> m;
    for (int b = 0; b < 256; ++b) m.emplace(byte_to_code_point()[b], static_cast<unsigned char>(b));
    return m;
  }();
  const auto cps = code_points(token);
  if (!cps) return std::string(token);
  std::string bytes;
  for (auto cp : *cps) {
    const auto it = inverse.find(cp);
    if (it == inverse.end()) return std::string(token);
    bytes.push_back(static_cast<char>(it->second));
  }
  return bytes;
}

// Rust's char::is_whitespace (Unicode White_Space), which HF uses for added tokens' lstrip/rstrip.
constexpr bool is_unicode_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// One compiled PCRE2 pattern, JIT-compiled when the platform allows.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error,
                          &offset, nullptr);
    if (!code_) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      throw ConfigError(fmt::format("{}: regex does not compile at offset {}: {}", where, offset,
                                    reinterpret_cast<const char*>(message.data())));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // without JIT (unsupported CPU) matching still works
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }
  const pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_ = nullptr;
};

struct MatchData {
  explicit MatchData(const Regex& regex) : data(pcre2_match_data_create_from_pattern(regex.code(), nullptr)) {}
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
  ~MatchData() { pcre2_match_data_free(data); }
  pcre2_match_data* data;
};

// Field `name` of `j` as a string, `fallback` when absent or null; `field` names it in the error
// (nlohmann's own, "type must be string, but is number", names nothing).
inline std::string string_field(const nlohmann::json& j, const char* name, const std::string& field,
                                std::string fallback) {
  const auto it = j.find(name);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string()) throw ConfigError(fmt::format("{} must be a string, got {}", field, it->dump()));
  return it->get<std::string>();
}

}  // namespace bpe_detail

class BpeTokenizer::BpeSession final : public Session {
 public:
  explicit BpeSession(const BpeTokenizer& t) : tokenizer_(t) {
    for (const auto& step : t.steps_)
      match_data_.push_back(step.regex ? std::make_unique<bpe_detail::MatchData>(*step.regex) : nullptr);
  }

  std::vector<std::int32_t> encode(std::string_view text) override {
    std::vector<std::int32_t> ids;
    split_added(text, /*normalized=*/false, ids);
    return ids;
  }

 private:
  // HF's AddedVocabulary: tokens with normalized false (the special ones) are split off first,
  // then those with normalized true inside what is left, then the rest is pre-tokenized.
  void split_added(std::string_view text, bool normalized, std::vector<std::int32_t>& ids) {
    std::size_t start = 0;
    while (start < text.size()) {
      const auto match = tokenizer_.find_added(text, start, normalized);
      const auto gap = text.substr(start, match.begin - start);
      if (normalized)
        encode_plain(gap, ids);
      else
        split_added(gap, true, ids);
      if (match.begin == text.size()) break;
      ids.push_back(match.id);
      start = match.end;
    }
  }

  // Text between added tokens: pre-tokenized step by step, then each piece merged.
  void encode_plain(std::string_view text, std::vector<std::int32_t>& ids) {
    if (text.empty()) return;
    pieces_.assign(1, std::string(text));
    for (std::size_t s = 0; s < tokenizer_.steps_.size(); ++s) {
      const auto& step = tokenizer_.steps_[s];
      next_pieces_.clear();
      for (auto& piece : pieces_) {
        if (step.kind == StepKind::byte_level && step.add_prefix_space && piece.front() != ' ') piece.insert(0, 1, ' ');
        if (step.regex)
          split(piece, *step.regex, *match_data_[s]);
        else
          next_pieces_.push_back(std::move(piece));
      }
      std::swap(pieces_, next_pieces_);
    }
    for (const auto& piece : pieces_) merge_piece(piece, ids);
  }

  // HF's Split with behavior "Isolated": each match is a piece, and so is each gap between them.
  void split(const std::string& piece, const bpe_detail::Regex& regex, bpe_detail::MatchData& md) {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
    std::size_t offset = 0, gap_start = 0;
    std::uint32_t options = 0;
    while (offset < piece.size()) {
      const int rc = pcre2_match(regex.code(), subject, piece.size(), offset, options, md.data, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        std::array<PCRE2_UCHAR, 256> message{};
        pcre2_get_error_message(rc, message.data(), message.size());
        throw DataError(fmt::format("{}: cannot pre-tokenize the text ({}); is it valid UTF-8?", tokenizer_.source_,
                                    reinterpret_cast<const char*>(message.data())));
      }
      options = PCRE2_NO_UTF_CHECK;  // checked once by the first call
      const auto* ovector = pcre2_get_ovector_pointer(md.data);
      const auto begin = ovector[0], end = ovector[1];
      if (begin > gap_start) next_pieces_.emplace_back(piece, gap_start, begin - gap_start);
      if (end > begin) {
        next_pieces_.emplace_back(piece, begin, end - begin);
        offset = end;
      } else {
        offset = end + 1;  // an empty match: step over one whole UTF-8 character
        while (offset < piece.size() && (static_cast<unsigned char>(piece[offset]) & 0xC0) == 0x80) ++offset;
        continue;
      }
      gap_start = end;
    }
    if (gap_start < piece.size()) next_pieces_.emplace_back(piece, gap_start, piece.size() - gap_start);
  }

  void merge_piece(const std::string& piece, std::vector<std::int32_t>& ids) {
    if (auto hit = cache_.find(piece); hit != cache_.end()) {
      ids.insert(ids.end(), hit->second.begin(), hit->second.end());
      return;
    }
    const auto first = ids.size();
    tokenizer_.merge(piece, ids, scratch_);
    if (cache_.size() < cache_capacity && piece.size() < 256)
      cache_.emplace(piece, std::vector<std::int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.end()));
  }

  static constexpr std::size_t cache_capacity = 100000;
  const BpeTokenizer& tokenizer_;
  std::vector<std::unique_ptr<bpe_detail::MatchData>> match_data_;
  std::vector<std::string> pieces_, next_pieces_;
  std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
  MergeScratch scratch_;
};

MESHTORCH_DECL BpeTokenizer BpeTokenizer::from_file(const std::filesystem::path& path) {
  const nlohmann::json j = io::read_json_file(path);
  return BpeTokenizer(j, path.string());
}

MESHTORCH_DECL BpeTokenizer::BpeTokenizer(const nlohmann::json& j, std::string source) : source_(std::move(source)) {
  if (!j.is_object()) throw ConfigError(fmt::format("{}: expected a JSON object at the top level", source_));
  // Real files number their tokens densely (vocab, then added tokens); the allowance leaves room
  // for gaps far larger than any seen.
  id_bound_ = id_gap_allowance;
  if (const auto model = j.find("model"); model != j.end() && model->is_object())
    if (const auto vocab = model->find("vocab"); vocab != model->end() && vocab->is_object())
      id_bound_ += static_cast<std::int64_t>(vocab->size());
  if (const auto added = j.find("added_tokens"); added != j.end() && added->is_array())
    id_bound_ += static_cast<std::int64_t>(added->size());
  read_model(field(j, "model"));
  if (auto n = j.find("normalizer"); n != j.end() && !n->is_null())
    throw ConfigError(fmt::format("{} is {}; only byte-level BPE without a normalizer is supported (null)",
                                  where("normalizer"), type_of(*n)));
  read_pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : nlohmann::json());
  read_decoder(j.contains("decoder") ? j["decoder"] : nlohmann::json());
  if (auto added = j.find("added_tokens"); added != j.end() && !added->is_null()) read_added_tokens(*added);
  // truncation, padding and post_processor are options of HF's encode call (cut to a length,
  // pad a batch, add <bos>); this class never truncates or pads, and documents get <bos>/<eos>
  // from encode_document, so they are not read.
}

MESHTORCH_DECL std::vector<std::int32_t> BpeTokenizer::encode(std::string_view text) const {
  return BpeSession(*this).encode(text);
}

MESHTORCH_DECL std::string BpeTokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string text;
  for (const auto id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= id_bytes_.size() || !id_known_[id])
      throw DataError(fmt::format("{}: token id {} is not in the vocabulary", source_, id));
    text += id_bytes_[id];
  }
  return text;
}

MESHTORCH_DECL std::optional<std::int32_t> BpeTokenizer::token_to_id(std::string_view token) const {
  for (const auto& added : added_)
    if (added.content == token) return added.id;
  if (auto it = vocab_.find(std::string(token)); it != vocab_.end()) return it->second;
  return std::nullopt;
}

MESHTORCH_DECL std::string BpeTokenizer::describe() const {
  return fmt::format("byte-level BPE ({}, {} tokens, {} merges, {} added)", source_, vocab_.size(), merges_.size(),
                     added_.size());
}

MESHTORCH_DECL std::unique_ptr<BpeTokenizer::Session> BpeTokenizer::start_session() const {
  return std::make_unique<BpeSession>(*this);
}

MESHTORCH_DECL std::string BpeTokenizer::where(std::string_view field) const {
  return source_ + ": field '" + std::string(field) + "'";
}

MESHTORCH_DECL std::string BpeTokenizer::type_of(const nlohmann::json& j) {
  if (j.is_object() && j.contains("type") && j["type"].is_string()) return "'" + j["type"].get<std::string>() + "'";
  return j.dump();
}

MESHTORCH_DECL const nlohmann::json& BpeTokenizer::field(const nlohmann::json& j, const std::string& name,
                                                         const std::string& path) const {
  const auto it = j.find(name);
  if (it == j.end() || it->is_null()) throw ConfigError(fmt::format("{} is missing", where(path + name)));
  return *it;
}

MESHTORCH_DECL bool BpeTokenizer::flag(const nlohmann::json& j, const std::string& name, bool fallback,
                                       const std::string& path) const {
  const auto it = j.find(name);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    throw ConfigError(fmt::format("{} must be true or false, got {}", where(path + name), it->dump()));
  return it->get<bool>();
}

MESHTORCH_DECL void BpeTokenizer::read_model(const nlohmann::json& model) {
  if (!model.is_object()) throw ConfigError(fmt::format("{} must be an object, got {}", where("model"), model.dump()));
  if (bpe_detail::string_field(model, "type", where("model.type"), "BPE") != "BPE")
    throw ConfigError(fmt::format("{} is {}; only 'BPE' is supported here", where("model.type"), type_of(model)));
  if (auto d = model.find("dropout"); d != model.end() && !d->is_null() && !(d->is_number() && d->get<double>() == 0))
    throw ConfigError(
        fmt::format("{} is {}; BPE dropout (random merges) is not supported", where("model.dropout"), d->dump()));
  for (const auto* name : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (auto it = model.find(name);
        it != model.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
      throw ConfigError(fmt::format("{} is {}; not supported by byte-level BPE here",
                                    where(std::string("model.") + name), it->dump()));
  if (flag(model, "byte_fallback", false, "model."))
    throw ConfigError(
        fmt::format("{} is true (a SentencePiece-style BPE); only byte-level BPE is supported from "
                    "tokenizer.json, use the folder's tokenizer.model",
                    where("model.byte_fallback")));
  ignore_merges_ = flag(model, "ignore_merges", false, "model.");
  fuse_unk_ = flag(model, "fuse_unk", false, "model.");

  const auto& vocab = field(model, "vocab", "model.");
  if (!vocab.is_object()) throw ConfigError(fmt::format("{} must be an object of token -> id", where("model.vocab")));
  std::int32_t max_id = -1;
  for (const auto& [token, id] : vocab.items()) {
    const auto checked = checked_id(
        id, fmt::format("{} gives token {}", where("model.vocab"),
                        nlohmann::json(token).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
    vocab_.emplace(token, checked);
    max_id = std::max(max_id, checked);
  }
  resize_ids(max_id + 1);
  for (const auto& [token, id] : vocab_) {
    auto bytes = bpe_detail::token_bytes(token);
    set_id(id, bytes);
    vocab_by_bytes_.emplace(std::move(bytes), id);
  }
  byte_id_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    std::string key;
    bpe_detail::append_utf8(bpe_detail::byte_to_code_point()[b], key);
    if (auto it = vocab_.find(key); it != vocab_.end()) byte_id_[b] = it->second;
  }
  if (auto unk = model.find("unk_token"); unk != model.end() && !unk->is_null()) {
    const auto it = vocab_.find(bpe_detail::string_field(model, "unk_token", where("model.unk_token"), ""));
    if (it == vocab_.end())
      throw ConfigError(fmt::format("{} {} is not in the vocabulary", where("model.unk_token"), unk->dump()));
    unk_id_ = it->second;
  }

  const auto& merges = field(model, "merges", "model.");
  if (!merges.is_array()) throw ConfigError(fmt::format("{} must be a list", where("model.merges")));
  merges_.reserve(merges.size());
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& m = merges[rank];
    std::string left, right;
    // Two spellings: "a b" (tokenizers before 0.20) and ["a", "b"] (since).
    if (m.is_string()) {
      const auto s = m.get<std::string>();
      const auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        throw ConfigError(
            fmt::format("{} {} is not two tokens", where("model.merges[" + std::to_string(rank) + "]"), m.dump()));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      throw ConfigError(
          fmt::format("{} {} is not two tokens", where("model.merges[" + std::to_string(rank) + "]"), m.dump()));
    }
    const auto l = vocab_.find(left), r = vocab_.find(right), merged = vocab_.find(left + right);
    if (l == vocab_.end() || r == vocab_.end() || merged == vocab_.end())
      throw ConfigError(fmt::format("{} {} names a token that is not in the vocabulary",
                                    where("model.merges[" + std::to_string(rank) + "]"), m.dump()));
    merges_.emplace(pair_key(l->second, r->second), Merge{static_cast<std::int32_t>(rank), merged->second});
  }
}

MESHTORCH_DECL void BpeTokenizer::read_pre_tokenizer(const nlohmann::json& pre) {
  if (pre.is_null())
    throw ConfigError(fmt::format("{} is missing; byte-level BPE needs a ByteLevel step", where("pre_tokenizer")));
  if (!pre.is_object())
    throw ConfigError(fmt::format("{} must be an object, got {}", where("pre_tokenizer"), pre.dump()));
  const bool sequence = bpe_detail::string_field(pre, "type", where("pre_tokenizer.type"), "") == "Sequence";
  if (sequence && !field(pre, "pretokenizers", "pre_tokenizer.").is_array())
    throw ConfigError(fmt::format("{} must be a list", where("pre_tokenizer.pretokenizers")));
  const std::vector<nlohmann::json> steps =
      sequence ? pre["pretokenizers"].get<std::vector<nlohmann::json>>() : std::vector<nlohmann::json>{pre};
  bool byte_level = false;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& step = steps[i];
    const std::string path =
        sequence ? "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]." : std::string("pre_tokenizer.");
    if (!step.is_object())
      throw ConfigError(
          fmt::format("{} must be an object, got {}", where(path.substr(0, path.size() - 1)), step.dump()));
    const auto type = bpe_detail::string_field(step, "type", where(path + "type"), "");
    if (byte_level)
      throw ConfigError(
          fmt::format("{} is '{}' after the ByteLevel step; only Split steps before one ByteLevel "
                      "step are supported",
                      where(path + "type"), type));
    if (type == "Split") {
      if (const auto behavior = step.find("behavior"); behavior == step.end() || *behavior != "Isolated")
        throw ConfigError(fmt::format("{} is {}; only 'Isolated' is supported", where(path + "behavior"),
                                      behavior == step.end() ? std::string("missing") : behavior->dump()));
      if (flag(step, "invert", false, path))
        throw ConfigError(fmt::format("{} is true; not supported", where(path + "invert")));
      const auto& pattern = field(step, "pattern", path);
      std::string regex;
      if (pattern.contains("Regex")) {
        regex = bpe_detail::string_field(pattern, "Regex", where(path + "pattern.Regex"), "");
      } else if (pattern.contains("String")) {
        regex = "\\Q" + bpe_detail::string_field(pattern, "String", where(path + "pattern.String"), "") + "\\E";
      } else {
        throw ConfigError(
            fmt::format("{} must hold 'Regex' or 'String', got {}", where(path + "pattern"), pattern.dump()));
      }
      steps_.push_back({StepKind::split, std::make_shared<bpe_detail::Regex>(regex, where(path + "pattern")), false});
    } else if (type == "ByteLevel") {
      byte_level = true;
      const bool use_regex = flag(step, "use_regex", true, path);
      // GPT-2's pattern, the one HF's ByteLevel applies when use_regex is true.
      static const std::string gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
      steps_.push_back({StepKind::byte_level,
                        use_regex ? std::make_shared<bpe_detail::Regex>(gpt2, where(path + "use_regex")) : nullptr,
                        flag(step, "add_prefix_space", false, path)});
    } else {
      throw ConfigError(fmt::format("{} is '{}'; supported: Split (Isolated) steps and one ByteLevel step",
                                    where(path + "type"), type));
    }
  }
  if (!byte_level)
    throw ConfigError(
        fmt::format("{} has no ByteLevel step; only byte-level BPE is supported", where("pre_tokenizer")));
}

MESHTORCH_DECL void BpeTokenizer::read_decoder(const nlohmann::json& decoder) {
  if (!decoder.is_object() || bpe_detail::string_field(decoder, "type", where("decoder.type"), "") != "ByteLevel")
    throw ConfigError(fmt::format("{} is {}; byte-level BPE needs the 'ByteLevel' decoder", where("decoder"),
                                  (decoder.is_null() ? std::string("missing") : type_of(decoder))));
}

MESHTORCH_DECL void BpeTokenizer::read_added_tokens(const nlohmann::json& added) {
  if (!added.is_array()) throw ConfigError(fmt::format("{} must be a list", where("added_tokens")));
  for (std::size_t i = 0; i < added.size(); ++i) {
    const auto& a = added[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "].";
    if (!a.is_object())
      throw ConfigError(
          fmt::format("{} must be an object, got {}", where("added_tokens[" + std::to_string(i) + "]"), a.dump()));
    if (flag(a, "single_word", false, path))
      throw ConfigError(fmt::format("{} is true for {}; single-word added tokens are not supported",
                                    where(path + "single_word"), field(a, "content", path).dump()));
    const auto id = checked_id(field(a, "id", path), where(path + "id") + " gives");
    const auto& content = field(a, "content", path);
    if (!content.is_string())
      throw ConfigError(fmt::format("{} must be a string, got {}", where(path + "content"), content.dump()));
    AddedToken token{id,
                     content.get<std::string>(),
                     flag(a, "special", false, path),
                     flag(a, "lstrip", false, path),
                     flag(a, "rstrip", false, path),
                     flag(a, "normalized", !flag(a, "special", false, path), path)};
    if (token.content.empty()) throw ConfigError(fmt::format("{} is empty", where(path + "content")));
    if (token.id >= static_cast<std::int32_t>(id_bytes_.size())) resize_ids(token.id + 1);
    set_id(token.id, token.content);
    added_by_first_byte_[token.normalized][static_cast<unsigned char>(token.content[0])].push_back(added_.size());
    added_.push_back(std::move(token));
  }
  // Longest first, so the first hit at a position is the leftmost-longest match.
  for (auto& table : added_by_first_byte_)
    for (auto& candidates : table)
      std::sort(candidates.begin(), candidates.end(),
                [&](std::size_t a, std::size_t b) { return added_[a].content.size() > added_[b].content.size(); });
}

MESHTORCH_DECL std::int32_t BpeTokenizer::checked_id(const nlohmann::json& id, const std::string& what) const {
  // Compared as written (unsigned, or beyond 64 bits as a float), never after a wrapping cast.
  const bool in_bound = id.is_number_unsigned()  ? id.get<std::uint64_t>() < static_cast<std::uint64_t>(id_bound_)
                        : id.is_number_integer() ? id.get<std::int64_t>() >= 0 && id.get<std::int64_t>() < id_bound_
                                                 : false;
  if (!in_bound)
    throw ConfigError(
        fmt::format("{} the id {}; ids must be integers from 0 to {} (the file's {} vocab entries and "
                    "added tokens, plus {} for gaps)",
                    what, id.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), id_bound_ - 1,
                    id_bound_ - id_gap_allowance, id_gap_allowance));
  return static_cast<std::int32_t>(id.get<std::int64_t>());
}

MESHTORCH_DECL void BpeTokenizer::resize_ids(std::int32_t count) {
  id_bytes_.resize(count);
  id_known_.resize(count, false);
}

MESHTORCH_DECL void BpeTokenizer::set_id(std::int32_t id, std::string bytes) {
  id_bytes_[id] = std::move(bytes);
  id_known_[id] = true;
}

// The leftmost-longest added token of one pass at or after `start`, or begin == text.size().
MESHTORCH_DECL BpeTokenizer::AddedMatch BpeTokenizer::find_added(std::string_view text, std::size_t start,
                                                                 bool normalized) const {
  if (added_.empty()) return {text.size(), text.size(), -1};
  const auto& table = added_by_first_byte_[normalized];
  for (auto pos = start; pos < text.size(); ++pos) {
    for (const auto index : table[static_cast<unsigned char>(text[pos])]) {
      const auto& token = added_[index];
      if (text.compare(pos, token.content.size(), token.content) != 0) continue;
      auto begin = pos, end = pos + token.content.size();
      if (token.lstrip) begin = std::max(start, whitespace_before(text, begin));
      if (token.rstrip) end = whitespace_after(text, end);
      return {begin, end, token.id};
    }
  }
  return {text.size(), text.size(), -1};
}

MESHTORCH_DECL std::size_t BpeTokenizer::whitespace_before(std::string_view text, std::size_t pos) {
  while (pos > 0) {
    auto lead = pos - 1;
    while (lead > 0 && (static_cast<unsigned char>(text[lead]) & 0xC0) == 0x80) --lead;
    const auto cps = bpe_detail::code_points(text.substr(lead, pos - lead));
    if (!cps || cps->size() != 1 || !bpe_detail::is_unicode_whitespace((*cps)[0])) break;
    pos = lead;
  }
  return pos;
}

MESHTORCH_DECL std::size_t BpeTokenizer::whitespace_after(std::string_view text, std::size_t pos) {
  while (pos < text.size()) {
    auto next = pos + 1;
    while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
    const auto cps = bpe_detail::code_points(text.substr(pos, next - pos));
    if (!cps || cps->size() != 1 || !bpe_detail::is_unicode_whitespace((*cps)[0])) break;
    pos = next;
  }
  return pos;
}

MESHTORCH_DECL void BpeTokenizer::merge(std::string_view piece, std::vector<std::int32_t>& ids, MergeScratch& s) const {
  if (ignore_merges_)
    if (auto it = vocab_by_bytes_.find(std::string(piece)); it != vocab_by_bytes_.end()) {
      ids.push_back(it->second);
      return;
    }
  const auto n = static_cast<std::int32_t>(piece.size());
  s.id.clear();
  for (std::int32_t i = 0; i < n; ++i) {
    const auto byte = static_cast<unsigned char>(piece[i]);
    auto id = byte_id_[byte];
    if (id < 0) {
      if (!unk_id_)
        throw DataError(fmt::format("{}: byte 0x{} has no token and the model has no unk_token", source_, hex(byte)));
      if (fuse_unk_ && !s.id.empty() && s.id.back() == *unk_id_) continue;
      id = *unk_id_;
    }
    s.id.push_back(id);
  }
  const auto m = static_cast<std::int32_t>(s.id.size());
  if (m <= 1) {
    ids.insert(ids.end(), s.id.begin(), s.id.end());
    return;
  }
  s.prev.resize(m);
  s.next.resize(m);
  for (std::int32_t i = 0; i < m; ++i) {
    s.prev[i] = i - 1;
    s.next[i] = i + 1 < m ? i + 1 : -1;
  }
  s.heap.clear();
  const auto greater = [](const auto& a, const auto& b) { return a.first > b.first; };
  auto push_pair = [&](std::int32_t left) {
    const auto right = s.next[left];
    if (left < 0 || right < 0) return;
    const auto it = merges_.find(pair_key(s.id[left], s.id[right]));
    if (it == merges_.end()) return;
    s.heap.emplace_back((static_cast<std::int64_t>(it->second.rank) << 32) | left, it->second.merged);
    std::push_heap(s.heap.begin(), s.heap.end(), greater);
  };
  for (std::int32_t i = 0; i + 1 < m; ++i) push_pair(i);
  while (!s.heap.empty()) {
    std::pop_heap(s.heap.begin(), s.heap.end(), greater);
    const auto [key, merged] = s.heap.back();
    s.heap.pop_back();
    const auto left = static_cast<std::int32_t>(key & 0xFFFFFFFF);
    const auto rank = static_cast<std::int32_t>(key >> 32);
    const auto right = s.next[left];
    if (s.id[left] < 0 || right < 0) continue;  // left was merged away, or is now last
    const auto it = merges_.find(pair_key(s.id[left], s.id[right]));
    if (it == merges_.end() || it->second.rank != rank) continue;  // the pair changed since
    s.id[left] = merged;
    s.id[right] = -1;
    s.next[left] = s.next[right];
    if (s.next[left] >= 0) s.prev[s.next[left]] = left;
    push_pair(s.prev[left]);
    push_pair(left);
  }
  for (std::int32_t i = 0; i >= 0; i = s.next[i]) ids.push_back(s.id[i]);
}

MESHTORCH_DECL std::string BpeTokenizer::hex(unsigned char byte) {
  constexpr char digits[] = "0123456789abcdef";
  return {digits[byte >> 4], digits[byte & 0xF]};
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
