#pragma once
// The C++ counterpart of torchelastic's @record: a program's main runs inside run_recorded, and
// an exception that escapes it is written as JSON to $TORCHELASTIC_ERROR_FILE, where meshrun
// and torchrun look for it to report which rank failed and why. Standard library only.
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

namespace detail {

MESHTORCH_DECL std::string demangled_name(const std::type_info& type);

// Hand-written so this header needs no JSON library; it only ever writes strings.
MESHTORCH_DECL std::string json_string(std::string_view text);

// "Type: what()" for the exception and each std::nested_exception under it, outermost first.
MESHTORCH_DECL void describe_exception_chain(const std::exception_ptr& error, std::string& first, std::string& chain);

}  // namespace detail

// The torchelastic error file's JSON for `error`. C++ exceptions carry no call stack, so
// "py_callstack" (the key torchelastic readers expect) holds the chain of nested exceptions.
MESHTORCH_DECL std::string error_file_json(const std::exception_ptr& error);

// Writes `error` to $TORCHELASTIC_ERROR_FILE when it is set; returns whether a file was written.
MESHTORCH_DECL bool record_error(const std::exception_ptr& error);

// Runs `body` (main's work, returning its exit code). An exception that escapes it is printed,
// recorded in the error file and turned into exit code 1, instead of std::terminate's abort.
// An exception escaping another thread still terminates, and is recorded on the way.
template <class Body>
int run_recorded(Body&& body) {
  static std::terminate_handler previous = std::set_terminate([] {
    if (auto error = std::current_exception()) record_error(error);
    previous ? previous() : std::abort();
  });
  try {
    return std::forward<Body>(body)();
  } catch (...) {
    auto error = std::current_exception();
    std::string message, chain;
    detail::describe_exception_chain(error, message, chain);
    std::cerr << chain << std::endl;
    record_error(error);
    return 1;
  }
}

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(core)
#include <chrono>
#include <cstdio>
#include <fstream>

#if defined(__GNUG__)
#include <cxxabi.h>
#endif

namespace meshtorch::diagnostics {

namespace detail {

MESHTORCH_DECL std::string demangled_name(const std::type_info& type) {
#if defined(__GNUG__)
  int status = 0;
  char* name = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  if (status == 0 && name) {
    std::string result(name);
    std::free(name);
    return result;
  }
#endif
  return type.name();
}

MESHTORCH_DECL std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
          out += escaped;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

MESHTORCH_DECL void describe_exception_chain(const std::exception_ptr& error, std::string& first, std::string& chain) {
  std::string line;
  const std::exception* nested_source = nullptr;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    line = demangled_name(typeid(e)) + ": " + e.what();
    nested_source = &e;
  } catch (...) {
    line = "unknown exception (not derived from std::exception)";
  }
  if (first.empty()) first = line;
  chain += (chain.empty() ? "" : "\ncaused by: ") + line;
  if (auto* nested = dynamic_cast<const std::nested_exception*>(nested_source); nested && nested->nested_ptr())
    describe_exception_chain(nested->nested_ptr(), first, chain);
}

}  // namespace detail

MESHTORCH_DECL std::string error_file_json(const std::exception_ptr& error) {
  std::string message, chain;
  detail::describe_exception_chain(error, message, chain);
  auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  return "{\"message\": {\"message\": " + detail::json_string(message) +
         ", \"extraInfo\": {\"py_callstack\": " + detail::json_string(chain) +
         ", \"timestamp\": " + detail::json_string(std::to_string(seconds)) + "}}}\n";
}

MESHTORCH_DECL bool record_error(const std::exception_ptr& error) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return false;
  std::ofstream file(path, std::ios::trunc);
  file << error_file_json(error);
  file.close();
  if (!file) std::cerr << "meshtorch: could not write the error file " << path << "\n";
  return static_cast<bool>(file);
}

}  // namespace meshtorch::diagnostics
#endif  // MESHTORCH_DEFINES(core)
