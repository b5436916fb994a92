#pragma once
// A compiled PCRE2 pattern (UTF and Unicode properties on) and its match data, owned: what the
// tokenizers match HF's Oniguruma regexes with. Link requirement: PCRE2 (libpcre2-8; CMake target
// meshtorch::tokenizers).
#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <array>
#include <string>

#include <fmt/format.h>
#include <pcre2.h>

#include <meshtorch/error.hpp>

namespace meshtorch::data {

// One compiled PCRE2 pattern, JIT-compiled when the platform allows.
class Pcre2Regex {
 public:
  Pcre2Regex(const std::string& pattern, const std::string& where) {
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
  Pcre2Regex(const Pcre2Regex&) = delete;
  Pcre2Regex& operator=(const Pcre2Regex&) = delete;
  ~Pcre2Regex() { pcre2_code_free(code_); }
  const pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_ = nullptr;
};

struct Pcre2MatchData {
  explicit Pcre2MatchData(const Pcre2Regex& regex)
      : data(pcre2_match_data_create_from_pattern(regex.code(), nullptr)) {}
  Pcre2MatchData(const Pcre2MatchData&) = delete;
  Pcre2MatchData& operator=(const Pcre2MatchData&) = delete;
  ~Pcre2MatchData() { pcre2_match_data_free(data); }
  pcre2_match_data* data;
};

}  // namespace meshtorch::data
