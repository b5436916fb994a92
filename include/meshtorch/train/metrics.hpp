#pragma once
// Metrics lines under the guide's keys, appended as one JSON object per log step to
// <save-dir>/<experiment>/metrics.jsonl (rank 0 only), so runs on any mesh can be compared.
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "meshtorch/error.hpp"

namespace meshtorch::train {

class MetricsFile {
 public:
  MetricsFile() = default;
  explicit MetricsFile(const std::filesystem::path& path) : path_(path), out_(path, std::ios::app) {
    if (!out_) throw DataError(path.string() + ": cannot open for appending metrics");
  }
  void append(const nlohmann::ordered_json& record) {
    if (!out_.is_open()) return;
    out_ << record.dump() << '\n';
    out_.flush();
  }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

// The one-line summary the guide logs each log step: "key=value, ..." with short floats.
inline std::string format_metrics(const nlohmann::ordered_json& record) {
  std::string line;
  for (const auto& [key, value] : record.items()) {
    if (!line.empty()) line += ", ";
    line += key + "=";
    if (value.is_number_float()) {
      char buffer[32];
      std::snprintf(buffer, sizeof buffer, "%.4g", value.get<double>());
      line += buffer;
    } else {
      line += value.dump();
    }
  }
  return line;
}

}  // namespace meshtorch::train
