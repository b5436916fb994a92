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

// One compiled PCRE2 pattern (data/pcre2_regex.hpp, which the definitions alone include).
class Pcre2Regex;

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
    std::shared_ptr<const Pcre2Regex> regex;  // split: the pattern; byte_level: GPT-2's or none
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
  void read_post_processor(const nlohmann::json& processor);

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
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/data/bpe_encoding.hpp>
#include <meshtorch/data/byte_level.hpp>

namespace meshtorch::data {

namespace bpe_detail {

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
  read_post_processor(j.contains("post_processor") ? j["post_processor"] : nlohmann::json());
  // truncation and padding are options of HF's encode call (cut to a length, pad a batch); this
  // class never truncates or pads, so they are not read.
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
    auto bytes = byte_level::token_bytes(token);
    set_id(id, bytes);
    vocab_by_bytes_.emplace(std::move(bytes), id);
  }
  byte_id_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    std::string key;
    byte_level::append_utf8(byte_level::byte_to_code_point()[b], key);
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
      steps_.push_back({StepKind::split, std::make_shared<Pcre2Regex>(regex, where(path + "pattern")), false});
    } else if (type == "ByteLevel") {
      byte_level = true;
      const bool use_regex = flag(step, "use_regex", true, path);
      // GPT-2's pattern, the one HF's ByteLevel applies when use_regex is true.
      static const std::string gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
      steps_.push_back({StepKind::byte_level,
                        use_regex ? std::make_shared<Pcre2Regex>(gpt2, where(path + "use_regex")) : nullptr,
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

// The template's special tokens around a single sequence ($A): what HF's encode adds by default,
// and what a prompt for generation gets (training documents take <bos>/<eos> from
// encode_document). TemplateProcessing, alone or in a Sequence; ByteLevel adds nothing; another
// processor (BERT's, RoBERTa's) is refused by name.
MESHTORCH_DECL void BpeTokenizer::read_post_processor(const nlohmann::json& processor) {
  if (processor.is_null()) return;
  const auto type = bpe_detail::string_field(processor, "type", where("post_processor.type"), "");
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    for (const auto& step : field(processor, "processors", "post_processor")) read_post_processor(step);
    return;
  }
  if (type != "TemplateProcessing")
    throw ConfigError(fmt::format("{} is '{}'; supported: TemplateProcessing, ByteLevel, Sequence of them, null",
                                  where("post_processor.type"), type));
  const auto& single = field(processor, "single", "post_processor");
  const auto& specials = processor.contains("special_tokens") ? processor["special_tokens"] : nlohmann::json::object();
  bool after = false;
  for (const auto& piece : single) {
    if (piece.contains("Sequence")) {
      after = true;
      continue;
    }
    const auto token = piece.contains("SpecialToken") && piece["SpecialToken"].contains("id") &&
                               piece["SpecialToken"]["id"].is_string()
                           ? piece["SpecialToken"]["id"].get<std::string>()
                           : std::string();
    const auto it = specials.find(token);
    if (token.empty() || it == specials.end() || !it->contains("ids") || !(*it)["ids"].is_array())
      throw ConfigError(fmt::format("{} holds {}, not a special token of post_processor.special_tokens",
                                    where("post_processor.single"), piece.dump()));
    for (const auto& id : (*it)["ids"]) {
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() >= id_bound_)
        throw ConfigError(fmt::format("{}: token '{}' has id {}, outside the vocabulary",
                                      where("post_processor.special_tokens"), token, id.dump()));
      (after ? added_after : added_before).push_back(id.get<std::int32_t>());
    }
  }
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
MESHTORCH_DECL std::string BpeTokenizer::hex(unsigned char byte) {
  constexpr char digits[] = "0123456789abcdef";
  return {digits[byte >> 4], digits[byte & 0xF]};
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
