#pragma once
// JSON that a user hands over (safetensors headers, model.safetensors.index.json, state.json,
// configs, tokenizer files, manifests, JSONL data lines),
// parsed with the limits nlohmann leaves to its caller:
// - nesting depth: nlohmann parses any depth, but copying or dumping a value recurses, so a file
//   of 100,000 '[' ends in a stack overflow as soon as an error message quotes it;
// - repeated keys: nlohmann keeps the last of two equal keys without a word, so a header or an
//   index could say two things about one tensor;
// - numbers out of range (1e999): nlohmann throws out_of_range, not parse_error.
// Errors name the file; the error type is the caller's (DataError for data, ConfigError for configs).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

// No file meshtorch reads nests deeper than 4; 64 leaves room and keeps recursion shallow.
inline constexpr int max_json_depth = 64;
// HF's limit on a safetensors header, and far beyond any config, index or state file.
inline constexpr std::uint64_t max_json_bytes = 100'000'000;

// Parses `text`; `where` names the file in messages, `document` what the top level is ("the
// header", "the file") in the message about a repeated key. With MESHTORCH_SEPARATE_COMPILATION
// this and read_json_file exist for Error = DataError and ConfigError.
template <class Error = DataError>
nlohmann::json parse_json(std::string_view text, const std::string& where, std::string_view document = "the file");

// The same, keeping each object's keys in the file's order (a JSONL record whose fields a chat
// template writes out in order, as Python does).
template <class Error = DataError>
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& where,
                                          std::string_view document = "the file");

// Reads and parses a JSON file, refusing a directory, device or pipe before opening it (reading
// a directory throws a raw ios_failure, opening a pipe blocks).
template <class Error = DataError>
nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view document = "the file");

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace meshtorch::io {

namespace json_detail {

// The checks of a first pass over the text, as SAX events (linear). nlohmann's own callback
// parser would do them in one pass, but at each object's end it scans the enclosing container,
// so an array of n objects costs n^2 (a manifest of 120,000 pieces: 4 s instead of 0.1 s).
template <class Error>
class BoundsCheck {
 public:
  BoundsCheck(const std::string& where, std::string_view document) : where_(where), document_(document) {}

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(nlohmann::json::number_integer_t) { return true; }
  bool number_unsigned(nlohmann::json::number_unsigned_t) { return true; }
  bool number_float(nlohmann::json::number_float_t, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(nlohmann::json::binary_t&) { return true; }
  bool start_object(std::size_t) { return open(true); }
  bool start_array(std::size_t) { return open(false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(std::string& key) {
    last_key_ = key;
    if (!open_.back().keys.insert(key).second)
      throw Error(fmt::format("{}: {} names '{}' twice", where_, open_.back().name, key));
    return true;
  }
  // parse_error, or out_of_range for a number like 1e999
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON ({})", where_, e.what()));
  }

 private:
  struct Container {
    bool is_object;
    std::string name;  // how messages call it
    std::set<std::string> keys;
  };

  bool open(bool is_object) {
    if (open_.size() >= static_cast<std::size_t>(max_json_depth))
      throw Error(fmt::format("{}: nested deeper than {} levels", where_, max_json_depth));
    std::string name = open_.empty()            ? std::string(document_)
                       : open_.back().is_object ? fmt::format("'{}'", last_key_)
                                                : fmt::format("an element of {}", open_.back().name);
    open_.push_back({is_object, std::move(name), {}});
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }

  const std::string& where_;
  std::string_view document_;
  std::vector<Container> open_;
  std::string last_key_;
};

// Both parses, checked the same way; Json is nlohmann::json or its key-ordered form.
template <class Error, class Json>
Json parse_bounded(std::string_view text, const std::string& where, std::string_view document) {
  BoundsCheck<Error> check(where, document);
  nlohmann::json::sax_parse(text.begin(), text.end(), &check);
  // Checked: no deeper than the limit, no repeated key, valid; the second pass only builds.
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON ({})", where, e.what()));
  }
}

}  // namespace json_detail

template <class Error>
nlohmann::json parse_json(std::string_view text, const std::string& where, std::string_view document) {
  return json_detail::parse_bounded<Error, nlohmann::json>(text, where, document);
}

template <class Error>
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& where, std::string_view document) {
  return json_detail::parse_bounded<Error, nlohmann::ordered_json>(text, where, document);
}

template <class Error>
nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view document) {
  const std::string where = path.string();
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (!std::filesystem::exists(status)) throw Error(fmt::format("{}: missing", where));
  if (!std::filesystem::is_regular_file(status))
    throw Error(fmt::format("{}: not a regular file (a directory, device or pipe)", where));
  const auto size = std::filesystem::file_size(path, error);
  if (error) throw Error(fmt::format("{}: cannot read its size ({})", where, error.message()));
  if (size > max_json_bytes)
    throw Error(fmt::format("{}: {} bytes, more than the {} a JSON file may have here", where, size, max_json_bytes));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open", where));
  std::string text(size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (!in || in.gcount() != static_cast<std::streamsize>(size))
    throw Error(fmt::format("{}: could not be read whole", where));
  return parse_json<Error>(text, where, document);
}

#if defined(MESHTORCH_SEPARATE_COMPILATION)
template nlohmann::json parse_json<DataError>(std::string_view, const std::string&, std::string_view);
template nlohmann::json parse_json<ConfigError>(std::string_view, const std::string&, std::string_view);
template nlohmann::ordered_json parse_ordered_json<DataError>(std::string_view, const std::string&, std::string_view);
template nlohmann::json read_json_file<DataError>(const std::filesystem::path&, std::string_view);
template nlohmann::json read_json_file<ConfigError>(const std::filesystem::path&, std::string_view);
#endif

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
