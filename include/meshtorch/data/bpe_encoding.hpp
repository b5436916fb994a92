#pragma once
// How BpeTokenizer (data/bpe_tokenizer.hpp, which reads tokenizer.json) encodes text: added tokens
// split off first, leftmost-longest in HF's two passes; each remaining stretch pre-tokenized by the
// Split and ByteLevel steps; each piece merged by rank. A session holds one thread's regex match
// data and its cache of merged pieces. Definitions only: the tokenizers part compiles them.
#include <meshtorch/data/bpe_tokenizer.hpp>

#if MESHTORCH_DEFINES(tokenizers)
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <meshtorch/data/byte_level.hpp>
#include <meshtorch/data/pcre2_regex.hpp>

namespace meshtorch::data {

class BpeTokenizer::BpeSession final : public Session {
 public:
  explicit BpeSession(const BpeTokenizer& t) : tokenizer_(t) {
    for (const auto& step : t.steps_)
      match_data_.push_back(step.regex ? std::make_unique<Pcre2MatchData>(*step.regex) : nullptr);
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
  void split(const std::string& piece, const Pcre2Regex& regex, Pcre2MatchData& md) {
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
  std::vector<std::unique_ptr<Pcre2MatchData>> match_data_;
  std::vector<std::string> pieces_, next_pieces_;
  std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
  MergeScratch scratch_;
};

MESHTORCH_DECL std::vector<std::int32_t> BpeTokenizer::encode(std::string_view text) const {
  return BpeSession(*this).encode(text);
}

MESHTORCH_DECL std::unique_ptr<BpeTokenizer::Session> BpeTokenizer::start_session() const {
  return std::make_unique<BpeSession>(*this);
}

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
    const auto cps = byte_level::code_points(text.substr(lead, pos - lead));
    if (!cps || cps->size() != 1 || !byte_level::is_unicode_whitespace((*cps)[0])) break;
    pos = lead;
  }
  return pos;
}

MESHTORCH_DECL std::size_t BpeTokenizer::whitespace_after(std::string_view text, std::size_t pos) {
  while (pos < text.size()) {
    auto next = pos + 1;
    while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
    const auto cps = byte_level::code_points(text.substr(pos, next - pos));
    if (!cps || cps->size() != 1 || !byte_level::is_unicode_whitespace((*cps)[0])) break;
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

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
