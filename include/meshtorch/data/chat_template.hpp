#pragma once
// A model folder's chat template, which turns a conversation ({"messages": [{"role", "content"}]})
// into the text the model is trained on, rendered as transformers' apply_chat_template renders it:
// chat_template.jinja when the folder has one (transformers 5 writes it), else tokenizer_config.json's
// "chat_template" (a string, or a list of named templates of which "default" is used); Jinja with
// trim_blocks and lstrip_blocks; the variables `messages`, `tools`, `add_generation_prompt`, the
// folder's special tokens (`bos_token`, `eos_token`, ...), `raise_exception(message)` and
// `strftime_now(format)` (the local time, as transformers gives it). Nothing is added to what the
// template writes: no system-role or tool polyfills.
//
// Jinja is minja's (one header, MIT): Debian packages no C++ Jinja engine, and one written here
// would be a second, less tested copy of what minja does for exactly these templates.
//
// Link requirements: minja's header (fetched by scripts/setup), PCRE2 and libsentencepiece (the
// folder's tokenizer files are read by folder_tokenizer.hpp's helpers): CMake target meshtorch::tokenizers.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/data/documents.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace minja {
class Context;  // <minja/minja.hpp>, which only the definitions below include
class TemplateNode;
}  // namespace minja

namespace meshtorch::data {

class ChatTemplate {
 public:
  // The folder's chat template, or nothing when it has none.
  static std::optional<ChatTemplate> from_folder(const std::filesystem::path& dir);

  // `source` is Jinja; `origin` names where it came from in error messages; `special_tokens` maps
  // names (bos_token, ...) to token strings the template may use.
  ChatTemplate(const std::string& source, std::string origin, const nlohmann::ordered_json& special_tokens);

  // What training writes a conversation with (documents.hpp): no generation prompt. It refers to
  // this template, which must outlive it.
  ChatRenderer for_training() const;

  // The text of a conversation: `messages` a list of {"role", "content", ...} objects, `tools` a
  // list of tool schemas or null. A template's raise_exception, or any other failure, is an error
  // naming `where` (the data file and line) and the template.
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt, const std::string& where) const;

  const std::string& origin() const { return origin_; }

 private:
  static std::string read_template_file(const std::filesystem::path& path);

  // "chat_template": a string, or [{"name": ..., "template": ...}] where "default" is the one used.
  static std::string template_from_config(const nlohmann::json& field, const std::filesystem::path& path);

  // The special tokens transformers passes to the template, as strings; names already set are
  // kept, so tokenizer_config.json wins.
  static void add_special_tokens(const nlohmann::json& config, const std::filesystem::path& path,
                                 nlohmann::ordered_json& out);

  // strftime itself, not fmt's chrono: templates use glibc's flags (Llama 3.1's "%d %b %Y", "%-d").
  static std::string local_time_as(const std::string& format);

  std::string origin_;
  std::shared_ptr<minja::TemplateNode> root_;
  std::shared_ptr<minja::Context> globals_;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#include <chrono>
#include <ctime>
#include <fstream>
#include <iterator>

#include <fmt/format.h>
#include <minja/minja.hpp>
#include <nlohmann/json.hpp>

namespace meshtorch::data {

MESHTORCH_DECL std::optional<ChatTemplate> ChatTemplate::from_folder(const std::filesystem::path& dir) {
  std::string source, origin;
  const auto config_path = dir / "tokenizer_config.json";
  const auto config = folder_detail::read_json_if_present(dir, "tokenizer_config.json");
  if (const auto path = folder_detail::folder_file_if_present(dir, "chat_template.jinja")) {
    source = read_template_file(*path);
    origin = path->string();
  } else if (config && config->contains("chat_template") && !(*config)["chat_template"].is_null()) {
    source = template_from_config((*config)["chat_template"], config_path);
    origin = fmt::format("{} 'chat_template'", config_path.string());
  } else {
    return std::nullopt;
  }
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  if (config) add_special_tokens(*config, config_path, special_tokens);
  if (const auto map = folder_detail::read_json_if_present(dir, "special_tokens_map.json"))
    add_special_tokens(*map, dir / "special_tokens_map.json", special_tokens);
  return ChatTemplate(source, origin, special_tokens);
}

MESHTORCH_DECL ChatTemplate::ChatTemplate(const std::string& source, std::string origin,
                                          const nlohmann::ordered_json& special_tokens)
    : origin_(std::move(origin)) {
  try {
    root_ = minja::Parser::parse(source, {.trim_blocks = true, .lstrip_blocks = true, .keep_trailing_newline = false});
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("{}: the chat template is not valid Jinja: {}", origin_, e.what()));
  }
  globals_ = minja::Context::make(minja::Value(special_tokens));
  globals_->set("strftime_now", minja::Value::callable([](const std::shared_ptr<minja::Context>&,
                                                           minja::ArgumentsValue& args) {
                  args.expectArgs("strftime_now", {1, 1}, {0, 0});
                  return minja::Value(local_time_as(args.args[0].get<std::string>()));
                }));
}

MESHTORCH_DECL ChatRenderer ChatTemplate::for_training() const {
  return [this](const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools, const std::string& where) {
    return render(messages, tools, /*add_generation_prompt=*/false, where);
  };
}

MESHTORCH_DECL std::string ChatTemplate::render(const nlohmann::ordered_json& messages,
                                                const nlohmann::ordered_json& tools, bool add_generation_prompt,
                                                const std::string& where) const {
  nlohmann::ordered_json values = {{"messages", messages}, {"add_generation_prompt", add_generation_prompt}};
  values["tools"] = tools;
  try {
    return root_->render(minja::Context::make(minja::Value(values), globals_));
  } catch (const std::exception& e) {
    throw DataError(fmt::format("{}: the chat template ({}) failed: {}", where, origin_, e.what()));
  }
}

MESHTORCH_DECL std::string ChatTemplate::read_template_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (!in.good() && !in.eof()) throw ConfigError(fmt::format("{}: could not be read", path.string()));
  return text;
}

MESHTORCH_DECL std::string ChatTemplate::template_from_config(const nlohmann::json& field,
                                                              const std::filesystem::path& path) {
  if (field.is_string()) return field.get<std::string>();
  if (field.is_array()) {
    std::string names;
    for (const auto& entry : field) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
          !entry["name"].is_string() || !entry["template"].is_string())
        throw ConfigError(fmt::format("{}: each entry of 'chat_template' must be {{\"name\": ..., \"template\": ...}}, "
                                      "got {}",
                                      path.string(), entry.dump()));
      if (entry["name"] == "default") return entry["template"].get<std::string>();
      names += (names.empty() ? "" : ", ") + entry["name"].get<std::string>();
    }
    throw ConfigError(fmt::format("{}: 'chat_template' names no 'default' template (it has: {})", path.string(),
                                  names.empty() ? "none" : names));
  }
  throw ConfigError(fmt::format("{}: 'chat_template' must be a string or a list of named templates, got {}",
                                path.string(), field.dump()));
}

MESHTORCH_DECL void ChatTemplate::add_special_tokens(const nlohmann::json& config, const std::filesystem::path& path,
                                                    nlohmann::ordered_json& out) {
  for (const char* name : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    const auto it = config.find(name);
    if (it == config.end() || it->is_null() || out.contains(name)) continue;
    out[name] = folder_detail::token_string(*it, name, path);
  }
}

MESHTORCH_DECL std::string ChatTemplate::local_time_as(const std::string& format) {
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm local{};
  localtime_r(&now, &local);
  char text[256];
  const auto size = std::strftime(text, sizeof text, format.c_str(), &local);
  return std::string(text, size);
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(tokenizers)
