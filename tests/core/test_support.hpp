#pragma once
// Helpers shared by the core tests.
#include <unistd.h>

#include <filesystem>
#include <string>

namespace meshtorch::testing {

namespace fs = std::filesystem;

// An empty folder of its own per test and process, so tests can run side by side.
inline fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("meshtorch-test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace meshtorch::testing
