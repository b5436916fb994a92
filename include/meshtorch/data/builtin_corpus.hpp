#pragma once
// The embedded default dataset (`-d builtin`): a deterministic corpus generated in the program,
// so nothing is downloaded. Its text has structure at several scales (spelling, templates,
// arithmetic that must be carried over, counting), so a small model's loss falls clearly and
// keeps falling for a while.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

namespace builtin_detail {

// splitmix64: tiny, fast and the same on every platform (std:: distributions are not).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
  template <class Array>
  std::string_view pick(const Array& words) {
    return words[below(words.size())];
  }
};

inline constexpr std::array<std::string_view, 16> adjectives{"quick",  "lazy",  "red",    "small", "bright", "quiet",
                                                             "old",    "young", "clever", "brave", "gentle", "heavy",
                                                             "silver", "wild",  "calm",   "happy"};
inline constexpr std::array<std::string_view, 16> nouns{"fox",    "dog",    "cat",     "bird",   "river",  "mountain",
                                                        "city",   "garden", "teacher", "farmer", "engine", "library",
                                                        "forest", "ship",   "child",   "robot"};
inline constexpr std::array<std::string_view, 12> verbs{"sees",    "follows", "helps",   "finds",
                                                        "watches", "carries", "paints",  "greets",
                                                        "builds",  "visits",  "answers", "remembers"};
inline constexpr std::array<std::string_view, 8> places{"by the sea",     "in the morning",  "near the bridge",
                                                        "after the rain", "under the stars", "at the market",
                                                        "on the hill",    "before dinner"};

template <class... Parts>
void append(std::string& text, const Parts&... parts) {
  (text.append(parts), ...);
}

}  // namespace builtin_detail

// Documents of a few sentences each; about `approx_bytes` bytes in all.
MESHTORCH_DECL std::vector<std::string> builtin_corpus(std::size_t approx_bytes = 2'000'000);

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(core)
namespace meshtorch::data {

MESHTORCH_DECL std::vector<std::string> builtin_corpus(std::size_t approx_bytes) {
  using namespace builtin_detail;
  SplitMix64 rng{20240601};
  std::vector<std::string> documents;
  std::size_t total = 0;
  while (total < approx_bytes) {
    std::string doc;
    const auto sentences = 3 + rng.below(5);
    for (std::uint64_t s = 0; s < sentences; ++s) {
      const auto noun = rng.pick(nouns);
      switch (rng.below(4)) {
        case 0: {
          // One draw per statement: the order of a call's arguments is unspecified.
          const auto adjective = rng.pick(adjectives);
          const auto verb = rng.pick(verbs);
          const auto object_adjective = rng.pick(adjectives);
          const auto object = rng.pick(nouns);
          const auto place = rng.pick(places);
          append(doc, "the ", adjective, " ", noun, " ", verb, " the ", object_adjective, " ", object, " ", place,
                 ". ");
          break;
        }
        case 1: {
          const auto a = rng.below(100), b = rng.below(100);
          append(doc, std::to_string(a), " plus ", std::to_string(b), " is ", std::to_string(a + b), ". ");
          break;
        }
        case 2: {
          const auto start = rng.below(50), step = 1 + rng.below(4);
          append(doc, "count by ", std::to_string(step), ":");
          for (std::uint64_t i = 0; i < 6; ++i) append(doc, " ", std::to_string(start + i * step));
          append(doc, ". ");
          break;
        }
        default:
          append(doc, "a ", noun, " is a ", noun, ", and two ", noun, "s are two ", noun, "s. ");
          break;
      }
    }
    doc.pop_back();
    total += doc.size() + 2;
    documents.push_back(std::move(doc));
  }
  return documents;
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(core)
