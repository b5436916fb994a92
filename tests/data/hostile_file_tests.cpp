// Hostile model-folder files: chat templates that recurse, loop or build text without end, and a
// tokenizer.json whose ids would allocate gigabytes. Each failed before its fix (a signal, an
// out-of-memory kill, minutes of work, or a raw library exception).
#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/data/bpe_tokenizer.hpp>
#include <meshtorch/data/chat_template.hpp>

#include "data_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;

namespace hostile_files {

using mt::testing::fixtures;
using mt::testing::fresh_dir;

// The message of the DataError that rendering `source` (saved as chat_template.jinja) throws.
std::string render_error(const std::string& name, const std::string& source,
                         const mt::data::ChatTemplateLimits* limits = nullptr) {
  const auto dir = fresh_dir("hostile-" + name);
  std::ofstream(dir / "chat_template.jinja") << source;
  auto chat = mt::data::ChatTemplate::from_folder(dir);
  REQUIRE(chat);
  if (limits) chat->set_limits(*limits);
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  try {
    const auto text = chat->render(messages, nullptr, false, "conv.jsonl:1");
    return "rendered " + std::to_string(text.size()) + " bytes";
  } catch (const mt::DataError& e) {
    return e.what();
  }
}

// The template's path as render_error writes it (fresh_dir's folder, without emptying it).
std::string origin(const std::string& name) {
  return (fs::temp_directory_path() / ("meshtorch-test-hostile-" + name + "-" + std::to_string(::getpid())) /
          "chat_template.jinja")
      .string();
}

// `work` on a thread of its own with a stack of `bytes` (std::thread's is the process's 8 MiB).
template <class Work>
void on_small_stack(std::size_t bytes, Work work) {
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setstacksize(&attributes, bytes);
  pthread_t thread;
  auto run = [](void* argument) -> void* {
    (*static_cast<Work*>(argument))();
    return nullptr;
  };
  REQUIRE(pthread_create(&thread, &attributes, run, &work) == 0);
  pthread_join(thread, nullptr);
  pthread_attr_destroy(&attributes);
}

}  // namespace hostile_files

using namespace hostile_files;

TEST_CASE("a chat template that recurses without end is stopped by name, not a stack overflow", "[chat][limits]") {
  const std::string recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
  CHECK(render_error("recursion", recursive) ==
        "conv.jsonl:1: the chat template " + origin("recursion") +
            " nests deeper than 256 levels (a macro that calls itself without end?); the limit is "
            "MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH");
  // Defined inside a loop, the macro's lookups never leave minja's own contexts: still stopped.
  CHECK_THAT(render_error("recursion-in-loop",
                          "{% for x in [1] %}{% macro g(n) %}{{ g(n + 1) }}{% endmacro %}{{ g(0) }}{% endfor %}"),
             Catch::Contains("nests deeper than 256 levels"));
  // A list that holds itself, printed: the dump recurses.
  CHECK_THAT(render_error("self-list", "{% set l = [] %}{% set _ = l.append(l) %}{{ l }}"),
             Catch::Contains("nests deeper than 256 levels"));

  // Raised past what the stack holds, the stack guard still ends it by name: on a thread with a
  // 384 KiB stack even the default depth would not fit (a level takes about 1 KiB).
  mt::data::ChatTemplateLimits deep;
  deep.max_depth = 100'000'000;
  std::string message;
  on_small_stack(384 << 10, [&] { message = render_error("recursion-stack", recursive); });
  CHECK_THAT(message, Catch::StartsWith("conv.jsonl:1: the chat template " + origin("recursion-stack") + " nests ") &&
                          Catch::Contains("KiB of stack this thread has left") &&
                          Catch::Contains("MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH"));
  CHECK_THAT(render_error("recursion-main-stack", recursive, &deep),
             Catch::Contains("KiB of stack this thread has left"));

  // Parsing recursed once per bracket or block: 100,000 '(' overflowed the stack before rendering.
  // 1,000 show the bound (minja's tokenizer takes time quadratic in the nesting: 10,000 take seconds).
  for (const auto& [name, source] : std::vector<std::pair<std::string, std::string>>{
           {"parens", "{{ " + std::string(1'000, '(') + "1" + std::string(1'000, ')') + " }}"},
           {"lists", "{{ " + std::string(1'000, '[') + std::string(1'000, ']') + " }}"},
           {"nots", "{{ " +
                        [] {
                          std::string nots;
                          for (int i = 0; i < 100'000; ++i) nots += "not ";
                          return nots;
                        }() +
                        "x }}"},
           {"blocks", [] {
              std::string blocks;
              for (int i = 0; i < 300; ++i) blocks += "{% if true %}";
              for (int i = 0; i < 300; ++i) blocks += "{% endif %}";
              return blocks;
            }()}}) {
    INFO(name);
    const auto dir = fresh_dir("hostile-parse-" + name);
    std::ofstream(dir / "chat_template.jinja") << source;
    CHECK_THROWS_WITH(mt::data::ChatTemplate::from_folder(dir),
                      "the chat template " + (dir / "chat_template.jinja").string() +
                          " nests deeper than 256 levels (brackets, 'not's or blocks in its text); the limit is "
                          "MESHTORCH_CHAT_TEMPLATE_MAX_DEPTH");
  }

  // A real template's depth is far below the limit.
  CHECK(render_error("nested-ok",
                     "{% for m in messages %}{% if m.role == 'user' %}{{ m.content | trim }}"
                     "{% endif %}{% endfor %}") == "rendered 2 bytes");
}

TEST_CASE("a chat template's loops and lists are bounded by name", "[chat][limits]") {
  const std::string limit =
      " runs more than 1000000 loop iterations and list items in one render; the limit is "
      "MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS";
  CHECK(render_error("range", "{% for i in range(100000000) %}x{% endfor %}") ==
        "conv.jsonl:1: the chat template " + origin("range") + limit);
  CHECK(render_error("range-huge", "{{ range(10000000000) | length }}") ==
        "conv.jsonl:1: the chat template " + origin("range-huge") + limit);
  // range with step 0 never ends by itself.
  CHECK_THAT(render_error("range-step0", "{{ range(1, 0, 0) | length }}"), Catch::EndsWith(limit));
  // Nested loops with no output: minutes of work before, a fraction of a second now.
  const auto start = std::chrono::steady_clock::now();
  CHECK_THAT(render_error("nested", "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}"),
             Catch::EndsWith(limit));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  // Doubling a list.
  CHECK_THAT(render_error("list-doubling",
                          "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                          "{% endfor %}{{ ns.l | length }}"),
             Catch::EndsWith(limit));

  // Raised by the variable, the same loop runs.
  ::setenv("MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS", "3000000", 1);
  CHECK(render_error("range-raised", "{% for i in range(1000000) %}{% endfor %}") == "rendered 0 bytes");
  ::setenv("MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS", "a lot", 1);
  CHECK_THROWS_WITH(mt::data::ChatTemplateLimits::from_environment(),
                    "MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS=a lot: expected a positive integer");
  ::unsetenv("MESHTORCH_CHAT_TEMPLATE_MAX_ITERATIONS");
}

TEST_CASE("a chat template's text is bounded before it is built", "[chat][limits]") {
  const std::string limit = "; the limit is MESHTORCH_CHAT_TEMPLATE_MAX_BYTES";
  // 4 GB asked for at once: refused before any of it is allocated.
  CHECK(render_error("repeat", "{{ 'x' * 4000000000 }}") ==
        "conv.jsonl:1: the chat template " + origin("repeat") +
            " builds more than 268435456 bytes of text in one render (a string of 4000000000 bytes after 0)" + limit);
  // Doubling a string 40 times.
  CHECK_THAT(render_error("doubling",
                          "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                          "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}"),
             Catch::StartsWith("conv.jsonl:1: the chat template " + origin("doubling") + " builds more than") &&
                 Catch::EndsWith(limit));
  // Copies of one string kept in a list, grown by replace, joined with a large separator, indented.
  for (const auto& [name, source] : std::vector<std::pair<std::string, std::string>>{
           {"copies",
            "{% set s = 'x' * 10000000 %}{% set l = [] %}{% for i in range(100000) %}"
            "{% set _ = l.append(s) %}{% endfor %}"},
           {"replace", "{{ ('x' * 1000).replace('x', 'y' * 1000000) }}"},
           {"join", "{{ range(100000) | join('y' * 10000) }}"},
           {"indent", "{{ ('a\\n' * 100000) | indent(100000) }}"},
           {"tojson", "{{ [[[[1]]]] | tojson(indent=100000000) }}"},
           // A list shared 100,000 times costs nothing to build, but printing it copies its text.
           {"shared",
            "{% set inner = ['x' * 10000000] %}{% set l = [] %}{% for i in range(100000) %}"
            "{% set _ = l.append(inner) %}{% endfor %}{{ l }}"}}) {
    INFO(name);
    CHECK_THAT(render_error(name, source),
               Catch::Contains(" builds more than 268435456 bytes") && Catch::EndsWith(limit));
  }
  mt::data::ChatTemplateLimits small;
  small.max_bytes = 1000;
  CHECK_THAT(render_error("output", "{% for i in range(2000) %}x{% endfor %}", &small),
             Catch::Contains(" builds more than 1000 bytes of text in one render (a string of 1 bytes after 1000)"));
}

TEST_CASE("a chat template's render is bounded in time", "[chat][limits]") {
  mt::data::ChatTemplateLimits quick;
  quick.max_seconds = 0.2;
  quick.max_iterations = 1'000'000'000;
  const auto start = std::chrono::steady_clock::now();
  CHECK(render_error("slow", "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}", &quick) ==
        "conv.jsonl:1: the chat template " + origin("slow") +
            " runs longer than 0.2 s; the limit is MESHTORCH_CHAT_TEMPLATE_MAX_SECONDS");
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

TEST_CASE("tokenizer.json ids are bounded by the file before anything is allocated", "[tokenizer][limits]") {
  const auto dir = fresh_dir("hostile-ids");
  const auto base = nlohmann::json::parse(std::ifstream(fixtures / "bpe" / "tokenizer.json"));
  // The edits below add one vocab entry, or change an added token's id.
  const auto entries = base["model"]["vocab"].size() + base["added_tokens"].size();
  auto tail = [&](std::size_t defined) {
    return fmt::format(
        "; ids must be integers from 0 to {} (the file's {} vocab entries and added tokens, plus "
        "65536 for gaps)",
        defined + 65536 - 1, defined);
  };
  auto error_with = [&](auto edit) {
    auto j = base;
    edit(j);
    std::ofstream(dir / "tokenizer.json") << j.dump();
    try {
      mt::data::BpeTokenizer::from_file(dir / "tokenizer.json");
      return std::string("loaded");
    } catch (const mt::ConfigError& e) {
      return std::string(e.what());
    }
  };
  for (const std::string id : {"300000000", "2147483647", "2000000000", "18446744073709551615", "-1", "1e300"}) {
    INFO(id);
    CHECK(error_with([&](nlohmann::json& j) { j["model"]["vocab"]["zzz"] = nlohmann::json::parse(id); }) ==
          (dir / "tokenizer.json").string() + ": field 'model.vocab' gives token \"zzz\" the id " +
              (id == "1e300" ? std::string("1e+300") : id) + tail(entries + 1));
    CHECK(error_with([&](nlohmann::json& j) { j["added_tokens"][0]["id"] = nlohmann::json::parse(id); }) ==
          (dir / "tokenizer.json").string() + ": field 'added_tokens[0].id' gives the id " +
              (id == "1e300" ? std::string("1e+300") : id) + tail(entries));
  }
  // An id within the bound, leaving a gap, loads.
  CHECK(error_with([&](nlohmann::json& j) { j["model"]["vocab"]["zzz"] = entries + 1 + 65536 - 1; }) == "loaded");
}
