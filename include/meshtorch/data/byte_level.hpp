#pragma once
// Byte-level BPE's text <-> bytes mapping (GPT-2's bytes_to_unicode, which HF `tokenizers`' ByteLevel
// pre-tokenizer and decoder use) and the UTF-8 helpers around it. No dependency: plain functions.
#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace meshtorch::data::byte_level {

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

// Appends `bytes` to `out` as valid UTF-8, each ill-formed part replaced by U+FFFD as Unicode's
// "maximal subpart" rule says (what Rust's from_utf8_lossy, and so HF's tokenizers' decode, does).
// A sequence cut short by the end of `bytes` is left out unless `last`: a stream of decoded text
// prints it once its next bytes have come. Returns the bytes consumed. By hand: the rule is a
// table of lead-byte ranges (Unicode's table 3-7), and no library in use here applies it.
inline std::size_t append_utf8_lossy(std::string_view bytes, std::string& out, bool last) {
  constexpr std::string_view replacement = "\xEF\xBF\xBD";
  std::size_t i = 0;
  while (i < bytes.size()) {
    const auto lead = static_cast<unsigned char>(bytes[i]);
    if (lead < 0x80) {
      out.push_back(static_cast<char>(lead));
      ++i;
      continue;
    }
    // The sequence's length and the range of its second byte (the others are 80..BF).
    int length = 0;
    unsigned char low = 0x80, high = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF)
      length = 2;
    else if (lead == 0xE0)
      length = 3, low = 0xA0;
    else if (lead >= 0xE1 && lead <= 0xEC)
      length = 3;
    else if (lead == 0xED)
      length = 3, high = 0x9F;
    else if (lead >= 0xEE && lead <= 0xEF)
      length = 3;
    else if (lead == 0xF0)
      length = 4, low = 0x90;
    else if (lead >= 0xF1 && lead <= 0xF3)
      length = 4;
    else if (lead == 0xF4)
      length = 4, high = 0x8F;
    if (length == 0) {  // not a lead byte
      out += replacement;
      ++i;
      continue;
    }
    std::size_t end = i + 1;
    while (end < bytes.size() && end < i + static_cast<std::size_t>(length)) {
      const auto b = static_cast<unsigned char>(bytes[end]);
      const bool fits = end == i + 1 ? (b >= low && b <= high) : (b >= 0x80 && b <= 0xBF);
      if (!fits) break;
      ++end;
    }
    if (end == i + static_cast<std::size_t>(length)) {
      out.append(bytes.substr(i, end - i));
    } else if (end == bytes.size() && !last) {
      return i;  // cut short: wait for the rest
    } else {
      out += replacement;  // the maximal subpart, one replacement
    }
    i = end;
  }
  return i;
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

}  // namespace meshtorch::data::byte_level
