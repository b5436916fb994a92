#pragma once
// Deterministic mutation fuzzing of the files a user hands over (fuzz_tests.cpp: config.json,
// safetensors, the weights index, state.json; file_fuzz_tests.cpp: checkpoints, tokenizer files,
// chat templates, DeepSpeed configs, data files and token caches). Every mutated input must load
// or give a meshtorch error (ConfigError, DataError); anything else fails the test with the
// input's number and seed:
// - another exception type (std::out_of_range, nlohmann's, c10::Error, ...);
// - std::bad_alloc or LibTorch's allocation error: the process runs under an address-space limit
//   (limit_memory), so an input that would allocate gigabytes ends there instead of in an
//   out-of-memory kill, and the library must bound sizes before it allocates;
// - an input that takes over 10 s; one that takes over 60 s ends the program, naming the input;
// - a signal ends the program (CTest reports it).
//   MESHTORCH_FUZZ_ITERATIONS  inputs per file kind (default 300); docs/reliability.md has a longer run
//   MESHTORCH_FUZZ_SEED        seed of the mutations (default 1); the same seed gives the same inputs
//   MESHTORCH_FUZZ_MEMORY_MB   address space allowed above the process's at the first input (default 3072)
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/error.hpp>

namespace meshtorch::testing::fuzz {

inline std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const auto value = std::strtoull(text, &end, 10);
  if (*end != '\0') FAIL(name << " must be a non-negative integer, not '" << text << "'");
  return value;
}

inline std::uint64_t iterations() { return env_number("MESHTORCH_FUZZ_ITERATIONS", 300); }

inline std::uint64_t seed_for(std::uint64_t parser) { return env_number("MESHTORCH_FUZZ_SEED", 1) * 1000003 + parser; }

// The process's address space now, from /proc/self/status (VmSize, in kB).
inline std::uint64_t address_space_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmSize:", 0) == 0) return std::strtoull(line.c_str() + 7, nullptr, 10) * 1024;
  return 0;
}

// Caps the address space (RLIMIT_AS: it counts malloc's heap and its mappings, LibTorch's
// allocations and mapped files alike) at what the process has at its first fuzzed input plus
// MESHTORCH_FUZZ_MEMORY_MB, once per process: every input after that must fit. The fuzzed files
// are a few KB; 3 GiB is more than any valid one needs and far less than a hostile size field asks.
inline void limit_memory() {
  static const bool limited = [] {
    const auto headroom = env_number("MESHTORCH_FUZZ_MEMORY_MB", 3072) << 20;
    const auto bound = address_space_bytes() + headroom;
    rlimit limit{};
    REQUIRE(::getrlimit(RLIMIT_AS, &limit) == 0);
    if (limit.rlim_max == RLIM_INFINITY || limit.rlim_max > bound) {
      limit.rlim_cur = bound;
      REQUIRE(::setrlimit(RLIMIT_AS, &limit) == 0);
    }
    return true;
  }();
  (void)limited;
}

// The message a stuck input leaves before the program ends (written from the SIGALRM handler,
// so prepared before each input).
inline char stuck_message[512];
inline constexpr unsigned stuck_seconds = 60;

inline void end_stuck_input(int) {
  [[maybe_unused]] const auto written = ::write(STDERR_FILENO, stuck_message, std::strlen(stuck_message));
  std::_Exit(124);
}

// Values that break parsers: wrong types, signs, and the edges of 32- and 64-bit integers and doubles.
inline const std::vector<nlohmann::json>& odd_values() {
  static const std::vector<nlohmann::json> values = {
      nullptr,
      true,
      false,
      0,
      -1,
      1,
      3,
      std::int64_t{2147483648},
      std::int64_t{-2147483649},
      std::uint64_t{4294967296},
      std::uint64_t{9007199254740993},
      std::numeric_limits<std::int64_t>::max(),
      std::numeric_limits<std::int64_t>::min(),
      std::numeric_limits<std::uint64_t>::max(),
      0.5,
      -0.0,
      1e308,
      -1e308,
      4.9e-324,
      "",
      "x",
      "F32",
      "llama3",
      nlohmann::json::array(),
      nlohmann::json::object(),
      nlohmann::json::array({1, 2}),
      nlohmann::json::array({-1}),
      nlohmann::json::array({std::numeric_limits<std::uint64_t>::max(), std::numeric_limits<std::uint64_t>::max()}),
      nlohmann::json::array({std::uint64_t{1} << 62, 4}),
      nlohmann::json::object({{"a", 1}})};
  return values;
}

// Text spliced into an input: numbers JSON types cannot hold, deep nesting, stray syntax, bad UTF-8.
inline const std::vector<std::string>& odd_texts() {
  static const std::vector<std::string> texts = {"1e999",
                                                 "-1e999",
                                                 "18446744073709551616",
                                                 "-9223372036854775809",
                                                 "NaN",
                                                 "Infinity",
                                                 "-0",
                                                 "0x10",
                                                 std::string(5000, '[') + std::string(5000, ']'),
                                                 std::string(5000, '['),
                                                 "\"\\u0000\"",
                                                 "\"\\ud800\"",
                                                 "\xff\xfe",
                                                 ",",
                                                 "}",
                                                 "]",
                                                 "\"",
                                                 ":",
                                                 "null",
                                                 "{\"\":{}}"};
  return texts;
}

// Integers written over a binary file's fields: the edges of signed and unsigned 32 and 64 bits.
inline const std::vector<std::uint64_t>& odd_integers() {
  static const std::vector<std::uint64_t> values = {0,
                                                    1,
                                                    2,
                                                    3,
                                                    4,
                                                    255,
                                                    65535,
                                                    65536,
                                                    0x7fffffff,
                                                    0x80000000,
                                                    0xffffffff,
                                                    std::uint64_t{1} << 32,
                                                    std::uint64_t{1} << 62,
                                                    0x7fffffffffffffff,
                                                    0x8000000000000000,
                                                    0x8000000000000008,
                                                    0xffffffffffffffff};
  return values;
}

class Mutator {
 public:
  explicit Mutator(std::uint64_t seed) : rng_(seed) {}

  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n); }

  // One to three mutations of `document`: structural ones (a value replaced, a key removed, added
  // or repeated) on the JSON, then byte-level ones on its text. `likely` are values that mean
  // something to this parser (tensor names, shard names, dtypes), picked as often as odd ones.
  std::string mutate_json(nlohmann::json document, const std::vector<nlohmann::json>& likely) {
    const std::size_t rounds = 1 + below(3);
    const std::size_t structural = below(rounds + 1);
    std::string repeated_key;
    for (std::size_t i = 0; i < structural; ++i) mutate_structure(document, likely, repeated_key);
    std::string text = document.dump(below(2) ? -1 : 2);
    if (!repeated_key.empty()) {
      const auto at = text.find("\"" + std::string(repeat_marker) + "\"");
      if (at != std::string::npos) text.replace(at, repeat_marker.size() + 2, nlohmann::json(repeated_key).dump());
    }
    for (std::size_t i = structural; i < rounds; ++i) text = mutate_bytes(std::move(text));
    return text;
  }

  // One byte-level mutation; `splices` are the texts it may insert (odd JSON by default).
  std::string mutate_bytes(std::string text, const std::vector<std::string>& splices = odd_texts()) {
    const std::size_t size = text.size();
    switch (below(6)) {
      case 0:  // flip one bit
        if (size) text[below(size)] ^= static_cast<char>(1 << below(8));
        break;
      case 1:  // overwrite one byte
        if (size) text[below(size)] = static_cast<char>(below(256));
        break;
      case 2:  // truncate
        text.resize(below(size + 1));
        break;
      case 3: {  // delete a range
        const auto from = below(size + 1);
        text.erase(from, below(size - from + 1));
        break;
      }
      case 4: {  // repeat a range
        const auto from = below(size + 1);
        text.insert(below(size + 1), text.substr(from, below(size - from + 1)));
        break;
      }
      default:  // splice in an odd text
        text.insert(below(size + 1), splices[below(splices.size())]);
    }
    return text;
  }

  // One to three mutations of a binary file: byte-level ones, or an odd 4- or 8-byte integer
  // written over a field, at one of `fields` (offsets of the format's size and count fields) or
  // anywhere.
  std::string mutate_binary(std::string data, const std::vector<std::size_t>& fields = {}) {
    const std::size_t rounds = 1 + below(3);
    for (std::size_t i = 0; i < rounds; ++i) {
      if (below(2)) {
        data = mutate_bytes(std::move(data), {std::string(8, '\xff'), std::string(8, '\0'), "\x80", "\x7f"});
        continue;
      }
      const std::size_t width = below(2) ? 4 : 8;
      if (data.size() < width) continue;
      std::size_t at = !fields.empty() && below(2) ? fields[below(fields.size())] : below(data.size() - width + 1);
      at = std::min(at, data.size() - width);
      const auto value = odd_integers()[below(odd_integers().size())];
      for (std::size_t b = 0; b < width; ++b) data[at + b] = static_cast<char>(value >> (8 * b));
    }
    return data;
  }

 private:
  static constexpr std::string_view repeat_marker = "@repeat-a-key-here@";

  const nlohmann::json& pick(const std::vector<nlohmann::json>& likely) {
    if (!likely.empty() && below(2)) return likely[below(likely.size())];
    return odd_values()[below(odd_values().size())];
  }

  static void collect(const nlohmann::json& value, const nlohmann::json::json_pointer& at,
                      std::vector<nlohmann::json::json_pointer>& paths) {
    paths.push_back(at);
    if (value.is_object())
      for (const auto& [key, child] : value.items()) collect(child, at / key, paths);
    if (value.is_array())
      for (std::size_t i = 0; i < value.size(); ++i) collect(value[i], at / i, paths);
  }

  void mutate_structure(nlohmann::json& document, const std::vector<nlohmann::json>& likely,
                        std::string& repeated_key) {
    std::vector<nlohmann::json::json_pointer> paths;
    collect(document, nlohmann::json::json_pointer(), paths);
    const auto path = paths[below(paths.size())];
    auto& node = document[path];
    switch (below(4)) {
      case 0:
        node = pick(likely);
        break;
      case 1:  // remove it from its parent
        if (!path.empty()) {
          auto& parent = document[path.parent_pointer()];
          if (parent.is_object()) parent.erase(path.back());
          if (parent.is_array()) parent.erase(parent.begin() + static_cast<std::ptrdiff_t>(std::stoul(path.back())));
        }
        break;
      case 2:  // add a key or an element
        if (node.is_object()) node["k" + std::to_string(below(4))] = pick(likely);
        if (node.is_array()) node.push_back(pick(likely));
        break;
      default:  // a key this object already has, a second time (its text is patched in after dumping)
        if (node.is_object() && !node.empty() && repeated_key.empty()) {
          auto key = node.begin();
          std::advance(key, static_cast<std::ptrdiff_t>(below(node.size())));
          repeated_key = key.key();
          node[std::string(repeat_marker)] = pick(likely);
        }
    }
  }

  std::mt19937_64 rng_;
};

// Runs `parse` on each input of one file kind; tallies loads and named refusals, fails on
// anything else, naming the input and the seed that reproduce it.
struct FuzzTally {
  std::string kind;
  std::uint64_t loaded = 0, refused = 0;
  double slowest_s = 0;

  explicit FuzzTally(std::string kind_name) : kind(std::move(kind_name)) {
    limit_memory();
    std::signal(SIGALRM, end_stuck_input);
  }

  template <class Parse>
  void run(std::uint64_t input, const std::string& excerpt, Parse&& parse) {
    const auto seed = env_number("MESHTORCH_FUZZ_SEED", 1);
    INFO(kind << " input #" << input << " (MESHTORCH_FUZZ_SEED=" << seed << "), starting: " << excerpt.substr(0, 300));
    std::snprintf(stuck_message, sizeof stuck_message,
                  "\n%s input #%llu (MESHTORCH_FUZZ_SEED=%llu) ran for more than %u s: ending the program\n",
                  kind.c_str(), static_cast<unsigned long long>(input), static_cast<unsigned long long>(seed),
                  stuck_seconds);
    ::alarm(stuck_seconds);
    const auto start = std::chrono::steady_clock::now();
    try {
      parse();
      ++loaded;
    } catch (const ConfigError&) {
      ++refused;
    } catch (const DataError&) {
      ++refused;
    } catch (const std::bad_alloc& e) {
      FAIL_CHECK(
          "out of memory under the fuzz limit (an allocation sized by the file, not bounded first): " << e.what());
    } catch (const std::exception& e) {
      FAIL_CHECK("not a meshtorch error: " << typeid(e).name() << ": " << e.what());
    }
    ::alarm(0);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    slowest_s = std::max(slowest_s, seconds);
    CHECK(seconds < 10);
  }

  void report() const {
    std::printf("%s: %llu inputs loaded, %llu refused with a named error, slowest %.3f s\n", kind.c_str(),
                static_cast<unsigned long long>(loaded), static_cast<unsigned long long>(refused), slowest_s);
    INFO(kind << ": " << loaded << " inputs loaded, " << refused << " refused with a named error, slowest " << slowest_s
              << " s");
    CHECK(loaded + refused == iterations());
    // Mutations that never reach a refusal would test nothing.
    if (iterations() >= 50) CHECK(refused > 0);
  }
};

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace meshtorch::testing::fuzz
