#pragma once
// The tokenizer of an HF model folder, chosen by what the folder holds: tokenizer.json (byte-level
// BPE), else tokenizer.model (SentencePiece). A folder with both whose tokenizer.json is not
// byte-level BPE (Llama 2's, converted from SentencePiece) uses tokenizer.model. <bos>/<eos> come
// from tokenizer_config.json ("bos_token"/"eos_token", "add_bos_token"), else from
// generation_config.json ("bos_token_id"/"eos_token_id"), else from the tokenizer itself.
//
// Link requirements: PCRE2 and libsentencepiece (CMake target meshtorch::tokenizers).
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <meshtorch/data/bpe_tokenizer.hpp>
#include <meshtorch/data/sentencepiece_tokenizer.hpp>
#include <meshtorch/data/text_tokenizer.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/json_file.hpp>
#include <meshtorch/io/model_folder.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

MESHTORCH_DECL bool folder_has_tokenizer(const std::filesystem::path& dir);

// The folder's tokenizer with its <bos>/<eos>; `note` (if given) receives what was chosen and why,
// for the caller's log.
MESHTORCH_DECL std::unique_ptr<TextTokenizer> load_tokenizer(const std::filesystem::path& dir,
                                                             std::string* note = nullptr);

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace meshtorch::data {

MESHTORCH_DECL bool folder_has_tokenizer(const std::filesystem::path& dir) {
  return std::filesystem::is_directory(dir) &&
         (io::present_in_folder(dir / "tokenizer.json") || io::present_in_folder(dir / "tokenizer.model"));
}

namespace folder_detail {

// The folder's file `name`, checked to lie inside the folder, or nothing when it is absent.
inline std::optional<std::filesystem::path> folder_file_if_present(const std::filesystem::path& dir,
                                                                   const std::string& name) {
  if (!io::present_in_folder(dir / name)) return std::nullopt;
  return io::model_file(dir, name, fmt::format("{}: the tokenizer file", dir.string()));
}

inline std::optional<nlohmann::json> read_json_if_present(const std::filesystem::path& dir, const std::string& name) {
  const auto path = folder_file_if_present(dir, name);
  if (!path) return std::nullopt;
  return io::read_json_file(*path);
}

struct ConfigToken {
  bool present = false;  // the field is there (null says: no such token)
  std::optional<std::int32_t> id;
};

// A special token as tokenizer_config.json or special_tokens_map.json writes it (field `field` of
// `path`): a string, or {"content": "..."} (AddedToken).
inline std::string token_string(const nlohmann::json& value, const std::string& field,
                                const std::filesystem::path& path) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  throw ConfigError(fmt::format("{}: field '{}' must be a token string, got {}", path.string(), field, value.dump()));
}

// tokenizer_config.json's "bos_token": a token string (see token_string), or null for none.
inline ConfigToken token_from_config(const nlohmann::json& config, const std::string& field,
                                     const TextTokenizer& tokenizer, const std::filesystem::path& path) {
  const auto it = config.find(field);
  if (it == config.end()) return {};
  if (it->is_null()) return {true, std::nullopt};
  const auto content = token_string(*it, field, path);
  const auto id = tokenizer.token_to_id(content);
  if (!id)
    throw ConfigError(fmt::format("{}: field '{}' names {}, which is not a token of {}", path.string(), field,
                                  nlohmann::json(content).dump(), tokenizer.describe()));
  return {true, id};
}

// generation_config.json's "eos_token_id": an id or a list of ids (Llama 3 instruct); the first is
// the one appended to documents.
inline std::optional<std::int32_t> id_from_generation_config(const nlohmann::json& config, const std::string& field,
                                                             const TextTokenizer& tokenizer,
                                                             const std::filesystem::path& path) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::nullopt;
  const nlohmann::json* value = &*it;
  if (it->is_array() && !it->empty()) value = &(*it)[0];
  if (!value->is_number_integer() || value->get<std::int64_t>() < 0 ||
      value->get<std::int64_t>() >= tokenizer.vocab_size())
    throw ConfigError(fmt::format("{}: field '{}' is {}, not an id below the vocabulary size {}", path.string(), field,
                                  it->dump(), tokenizer.vocab_size()));
  return static_cast<std::int32_t>(value->get<std::int64_t>());
}

}  // namespace folder_detail

MESHTORCH_DECL std::unique_ptr<TextTokenizer> load_tokenizer(const std::filesystem::path& dir, std::string* note) {
  const auto json_path = folder_detail::folder_file_if_present(dir, "tokenizer.json");
  const auto model_path = folder_detail::folder_file_if_present(dir, "tokenizer.model");
  std::unique_ptr<TextTokenizer> tokenizer;
  std::string why;
  if (json_path) {
    try {
      tokenizer = std::make_unique<BpeTokenizer>(BpeTokenizer::from_file(*json_path));
    } catch (const ConfigError& e) {
      if (!model_path) throw;
      why = std::string(e.what()) + "; using tokenizer.model instead";
    }
  }
  if (!tokenizer && model_path) tokenizer = std::make_unique<SentencePieceTokenizer>(*model_path);
  if (!tokenizer) throw DataError(fmt::format("{}: holds no tokenizer.json or tokenizer.model", dir.string()));

  std::string bos_from = "the tokenizer", eos_from = "the tokenizer";
  const auto generation_path = dir / "generation_config.json";
  if (const auto generation = folder_detail::read_json_if_present(dir, "generation_config.json")) {
    if (auto id = folder_detail::id_from_generation_config(*generation, "bos_token_id", *tokenizer, generation_path)) {
      tokenizer->bos_id = id;
      bos_from = "generation_config.json";
    }
    if (auto id = folder_detail::id_from_generation_config(*generation, "eos_token_id", *tokenizer, generation_path)) {
      tokenizer->eos_id = id;
      eos_from = "generation_config.json";
    }
  }
  // tokenizer_config.json is what HF's tokenizer classes read, so it wins over generation_config.json.
  const auto config_path = dir / "tokenizer_config.json";
  if (const auto config = folder_detail::read_json_if_present(dir, "tokenizer_config.json")) {
    if (const auto token = folder_detail::token_from_config(*config, "bos_token", *tokenizer, config_path);
        token.present) {
      tokenizer->bos_id = token.id;
      bos_from = "tokenizer_config.json";
    }
    if (const auto token = folder_detail::token_from_config(*config, "eos_token", *tokenizer, config_path);
        token.present) {
      tokenizer->eos_id = token.id;
      eos_from = "tokenizer_config.json";
    }
    if (auto add = config->find("add_bos_token"); add != config->end() && add->is_boolean() && !add->get<bool>()) {
      // As transformers' Llama tokenizers rebuild their template without it.
      if (tokenizer->bos_id) std::erase(tokenizer->added_before, *tokenizer->bos_id);
      tokenizer->bos_id.reset();
      bos_from = "tokenizer_config.json (add_bos_token false)";
    }
  }
  // A SentencePiece model adds <bos> to a text as transformers' LlamaTokenizer does (add_bos_token,
  // true unless the config says false).
  if (model_path && dynamic_cast<SentencePieceTokenizer*>(tokenizer.get()) && tokenizer->bos_id)
    tokenizer->added_before = {*tokenizer->bos_id};
  if (note) {
    auto id_text = [](const std::optional<std::int32_t>& id) { return id ? std::to_string(*id) : std::string("none"); };
    *note = fmt::format("{}; bos {} from {}, eos {} from {}{}", tokenizer->describe(), id_text(tokenizer->bos_id),
                        bos_from, id_text(tokenizer->eos_id), eos_from, why.empty() ? "" : "; " + why);
  }
  return tokenizer;
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
