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
// A template is code from a downloaded folder, so each render runs under limits (ChatTemplateLimits):
// nesting depth, loop iterations, bytes of text built and wall time, each an error naming the
// template and the environment variable that raises it. minja has no such bounds, and a recursive
// macro overflows the stack from inside it, so scripts/minja-limits.patch (applied by scripts/setup)
// adds one hook that minja calls before each level, iteration and string it makes.
//
// Link requirements: minja's header (fetched by scripts/setup), PCRE2 and libsentencepiece (the
// folder's tokenizer files are read by folder_tokenizer.hpp's helpers): CMake target meshtorch::tokenizers.
#include <cstddef>
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

// What one render may do. A real template renders a conversation in well under a millisecond,
// 16 levels deep at most, with a few iterations per message: the defaults are far above that.
struct ChatTemplateLimits {
  std::size_t max_depth = 256;                     // MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH: nodes, expressions, values
  std::size_t max_iterations = 1'000'000;          // MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS: loop runs and list items
  std::size_t max_bytes = std::size_t{256} << 20;  // MESHTORCH_CHAT_TEMPLATE_MAX_BYTES: all text built, output included
  double max_seconds = 10;                         // MESHTORCH_CHAT_TEMPLATE_MAX_SECONDS: wall time

  // The defaults, each replaced by its environment variable where set (a positive number, or a
  // ConfigError naming the variable).
  static ChatTemplateLimits from_environment();
};

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

  // Set from the environment at construction (ChatTemplateLimits::from_environment).
  const ChatTemplateLimits& limits() const { return limits_; }
  void set_limits(const ChatTemplateLimits& limits) { limits_ = limits; }

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
  ChatTemplateLimits limits_;
  std::shared_ptr<minja::TemplateNode> root_;
  std::shared_ptr<minja::Context> globals_;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(tokenizers)
#include <pthread.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include <fmt/format.h>
#include <minja/minja.hpp>
#include <nlohmann/json.hpp>

#ifndef MINJA_RENDER_LIMITS
// A minja without scripts/minja-limits.patch would render templates without any bound.
#error "this minja.hpp has no render limits: apply scripts/minja-limits.patch (scripts/setup does)"
#endif

namespace meshtorch::data {

namespace chat_detail {

// Reads one limit from the environment: unset or empty keeps `fallback`.
template <class T>
T limit_from_env(const char* name, T fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text, &end);
  const bool whole = std::is_floating_point_v<T> || value == static_cast<double>(static_cast<long long>(value));
  if (errno != 0 || end == text || *end != '\0' || !(value > 0) || !whole ||
      value > static_cast<double>(std::numeric_limits<std::int64_t>::max()))
    throw ConfigError(fmt::format("{}={}: expected a positive {}", name, text,
                                  std::is_floating_point_v<T> ? "number of seconds" : "integer"));
  return static_cast<T>(value);
}

// What one render has used, told by minja's hook (scripts/minja-limits.patch) before each level,
// iteration or string. The first limit passed is kept and thrown again at every later call, so
// that no catch inside minja (to_int swallows everything) can carry the render on.
class RenderBudget final : public minja::RenderLimits {
 public:
  // `parsing`: the template is being parsed, where nesting is brackets and blocks, not calls.
  RenderBudget(const ChatTemplateLimits& limits, const std::string& origin, bool parsing = false)
      : limits_(limits), origin_(origin), parsing_(parsing), start_(std::chrono::steady_clock::now()) {
    // The stack this thread has left: a depth limit alone cannot know how large a thread's stack
    // is, and a level of minja's costs about 1 KiB of it.
    char here = 0;
    stack_top_ = reinterpret_cast<std::uintptr_t>(&here);
    pthread_attr_t attributes;
    void* base = nullptr;
    std::size_t size = 0;
    if (pthread_getattr_np(pthread_self(), &attributes) == 0) {
      pthread_attr_getstack(&attributes, &base, &size);
      pthread_attr_destroy(&attributes);
    }
    const auto left = base ? stack_top_ - reinterpret_cast<std::uintptr_t>(base) : std::size_t{8} << 20;
    stack_budget_ = left > stack_reserve ? left - stack_reserve : 0;
    previous_ = minja::render_limits;
    minja::render_limits = this;
  }
  ~RenderBudget() override { minja::render_limits = previous_; }
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;

  void enter() override {
    check_time();
    if (depth_ + 1 > limits_.max_depth)
      fail(fmt::format("nests deeper than {} levels ({}); the limit is MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH",
                       limits_.max_depth,
                       parsing_ ? "brackets, 'not's or blocks in its text" : "a macro that calls itself without end?"));
    char here = 0;
    const auto used = stack_top_ - reinterpret_cast<std::uintptr_t>(&here);
    if (used > stack_budget_)
      fail(
          fmt::format("nests {} levels deep and would use more than the {} KiB of stack this thread has left; "
                      "the limit is MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH, or a thread with a larger stack",
                      depth_, stack_budget_ >> 10));
    ++depth_;
  }
  void leave() noexcept override { --depth_; }
  void items(std::size_t count) override {
    check_time();
    iterations_ = count > limits_.max_iterations - iterations_ ? limits_.max_iterations + 1 : iterations_ + count;
    if (iterations_ > limits_.max_iterations)
      fail(
          fmt::format("runs more than {} loop iterations and list items in one render; the limit is "
                      "MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS",
                      limits_.max_iterations));
  }
  void text(std::size_t bytes) override {
    check_time();
    if (bytes > limits_.max_bytes - bytes_)
      fail(
          fmt::format("builds more than {} bytes of text in one render (a string of {} bytes after {}); the limit "
                      "is MESHTORCH_CHAT_TEMPLATE_MAX_BYTES",
                      limits_.max_bytes, bytes, bytes_));
    bytes_ += bytes;
  }

  const std::optional<std::string>& failure() const { return failure_; }

 private:
  // Kept below the deepest level allowed for minja's frames, the exception and its message.
  static constexpr std::size_t stack_reserve = std::size_t{256} << 10;

  void check_time() {
    if (failure_) throw minja::RenderLimitError(*failure_);
    if (++calls_ % 256 != 0) return;
    const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - start_;
    if (spent.count() > limits_.max_seconds)
      fail(fmt::format("{} longer than {} s; the limit is MESHTORCH_CHAT_TEMPLATE_MAX_SECONDS",
                       parsing_ ? "takes" : "runs", limits_.max_seconds));
  }
  [[noreturn]] void fail(std::string what) {
    failure_ = fmt::format("{} {}", origin_, what);
    throw minja::RenderLimitError(*failure_);
  }

  const ChatTemplateLimits& limits_;
  const std::string& origin_;
  bool parsing_;
  std::chrono::steady_clock::time_point start_;
  std::uintptr_t stack_top_ = 0;
  std::size_t stack_budget_ = 0;
  std::size_t depth_ = 0, iterations_ = 0, bytes_ = 0, calls_ = 0;
  std::optional<std::string> failure_;
  minja::RenderLimits* previous_ = nullptr;
};

}  // namespace chat_detail

MESHTORCH_DECL ChatTemplateLimits ChatTemplateLimits::from_environment() {
  ChatTemplateLimits limits;
  limits.max_depth = chat_detail::limit_from_env("MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH", limits.max_depth);
  limits.max_iterations = chat_detail::limit_from_env("MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS", limits.max_iterations);
  limits.max_bytes = chat_detail::limit_from_env("MESHTORCH_CHAT_TEMPLATE_MAX_BYTES", limits.max_bytes);
  limits.max_seconds = chat_detail::limit_from_env("MESHTORCH_CHAT_TEMPLATE_MAX_SECONDS", limits.max_seconds);
  return limits;
}

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
    : origin_(std::move(origin)), limits_(ChatTemplateLimits::from_environment()) {
  // minja's parser recurses once per bracket and block: 100,000 '(' overflowed the stack.
  chat_detail::RenderBudget budget(limits_, origin_, /*parsing=*/true);
  try {
    root_ = minja::Parser::parse(source, {.trim_blocks = true, .lstrip_blocks = true, .keep_trailing_newline = false});
  } catch (const std::exception& e) {
    if (budget.failure()) throw ConfigError(fmt::format("the chat template {}", *budget.failure()));
    throw ConfigError(fmt::format("{}: the chat template is not valid Jinja: {}", origin_, e.what()));
  }
  globals_ = minja::Context::make(minja::Value(special_tokens));
  globals_->set("strftime_now",
                minja::Value::callable([](const std::shared_ptr<minja::Context>&, minja::ArgumentsValue& args) {
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
  chat_detail::RenderBudget budget(limits_, origin_);
  try {
    return root_->render(minja::Context::make(minja::Value(values), globals_));
  } catch (const std::exception& e) {
    if (budget.failure()) throw DataError(fmt::format("{}: the chat template {}", where, *budget.failure()));
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
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") || !entry["name"].is_string() ||
          !entry["template"].is_string())
        throw ConfigError(
            fmt::format("{}: each entry of 'chat_template' must be {{\"name\": ..., \"template\": ...}}, "
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
  for (const char* name :
       {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
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
