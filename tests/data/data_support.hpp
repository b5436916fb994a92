#pragma once
// Helpers shared by the data tests (one translation unit: see CMakeLists.txt).
#include <exception>
#include <filesystem>
#include <string>

#include "../core/test_support.hpp"

namespace meshtorch::testing {

// The checked-in tokenizers, corpus and reference ids (fixtures/, made by make_tokenizers.py).
inline const std::filesystem::path fixtures = MESHTORCH_DATA_FIXTURES;

// What `work` throws, or "no error".
template <class Work>
std::string error_of(Work&& work) {
  try {
    work();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace meshtorch::testing
