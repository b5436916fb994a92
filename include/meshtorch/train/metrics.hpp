#pragma once
// Metrics lines under the guide's keys, appended as one JSON object per log step to
// <save-dir>/<experiment>/metrics.jsonl (rank 0 only), so runs on any mesh can be compared.
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json_fwd.hpp>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/memory.hpp>
#include <meshtorch/train/state.hpp>
#include <meshtorch/train/timers.hpp>

namespace meshtorch::train {

// Where a rank's metrics go besides metrics.jsonl (train/tensorboard.hpp writes TensorBoard event
// files): the Experiment calls on_start with the step the run starts at (after resuming), then
// on_metrics with each record, on every rank that has a tracker.
struct MetricsTracker {
  virtual ~MetricsTracker() = default;
  virtual void on_start(std::int64_t global_step) = 0;
  virtual void on_metrics(const nlohmann::ordered_json& record) = 0;
};

class MetricsFile {
 public:
  MetricsFile() = default;
  // A last line without its newline (a run that ended on a full disk mid-line) is completed first,
  // so the next record starts a line of its own: kept with a newline added when it is a whole
  // JSON object, else moved to metrics.discarded.jsonl and cut from the file.
  MESHTORCH_DECL explicit MetricsFile(const std::filesystem::path& path);
  // A line that cannot be written (disk full, quota) is an error, never a silent gap.
  MESHTORCH_DECL void append(const nlohmann::ordered_json& record);

  // Moves the lines of steps after `step` to metrics.discarded.jsonl beside the file and returns
  // how many: a run that restarts from its checkpoint at `step` (a crash, an elastic restart,
  // --no-resume) logs those steps again, and the file must hold each step once. Nothing is lost:
  // the set-aside lines are appended there before the file is replaced by its kept lines.
  MESHTORCH_DECL std::size_t set_aside_after(std::int64_t step);

  static constexpr const char* file_name = "metrics.jsonl";  // in the experiment folder
  static constexpr const char* discarded_name = "metrics.discarded.jsonl";

 private:
  static void write_file(const std::filesystem::path& path, const std::string& text, std::ios::openmode mode) {
    std::ofstream out(path, mode);
    out << text;
    out.flush();
    if (!out) throw DataError(fmt::format("{}: writing failed ({})", path.string(), std::strerror(errno)));
  }

  std::filesystem::path path_;
  std::ofstream out_;
};

// The one-line summary the guide logs each log step: "key=value, ..." with short floats.
MESHTORCH_DECL std::string format_metrics(const nlohmann::ordered_json& record);

// The figures of one log line, over the steps since the previous line: the log window. It owns
// the window's clock, and closing a window resets what the next one measures (running loss,
// phase timers, peak memory).
class LogWindow {
 public:
  LogWindow(torch::Device device, std::int64_t tokens_per_step) : device_(device), tokens_per_step_(tokens_per_step) {
    restart();
  }

  // Time spent on something other than training (a checkpoint save) is left out of tokens_per_s.
  void exclude(std::chrono::steady_clock::duration pause) { start_ += pause; }

  // The guide's keys; times are milliseconds per step, memory in GiB.
  MESHTORCH_DECL nlohmann::ordered_json record(const TrainState& state, std::int64_t steps_per_epoch, double lr,
                                               const PhaseTimers& timers) const;

  void close(TrainState& state, PhaseTimers& timers) {
    state.running_loss = 0;
    state.running_steps = 0;
    timers.reset();
    restart();
  }

 private:
  void restart() {
    reset_peak_memory(device_);
    start_ = std::chrono::steady_clock::now();
  }

  torch::Device device_;
  std::int64_t tokens_per_step_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <system_error>

#include <nlohmann/json.hpp>

#include <meshtorch/io/json_file.hpp>

namespace meshtorch::train {

MESHTORCH_DECL MetricsFile::MetricsFile(const std::filesystem::path& path) : path_(path) {
  std::error_code error;
  const auto size = std::filesystem::is_regular_file(path_, error) ? std::filesystem::file_size(path_, error) : 0;
  if (!error && size > 0) {
    std::ifstream in(path_, std::ios::binary);
    // Back from the end, a block at a time, to the last newline.
    std::uintmax_t start = size;
    std::string block;
    for (bool found = false; start > 0 && !found;) {
      const auto length = std::min<std::uintmax_t>(start, 1 << 16);
      block.resize(static_cast<std::size_t>(length));
      in.seekg(static_cast<std::streamoff>(start - length));
      in.read(block.data(), static_cast<std::streamsize>(length));
      if (!in) throw DataError(fmt::format("{}: could not be read ({})", path_.string(), std::strerror(errno)));
      const auto newline = block.rfind('\n');
      found = newline != std::string::npos;
      start -= found ? length - newline - 1 : length;
    }
    if (start < size) {
      std::string torn(static_cast<std::size_t>(size - start), '\0');
      in.seekg(static_cast<std::streamoff>(start));
      in.read(torn.data(), static_cast<std::streamsize>(torn.size()));
      in.close();
      bool whole = false;
      try {
        whole = io::parse_json<DataError>(torn, path_.string(), "a metrics line").is_object();
      } catch (const DataError&) {
      }
      if (whole) {
        write_file(path_, "\n", std::ios::app);
      } else {
        write_file(path_.parent_path() / discarded_name, torn + "\n", std::ios::app);
        std::filesystem::resize_file(path_, start);
      }
    }
  }
  out_.open(path_, std::ios::app);
  if (!out_) throw DataError(fmt::format("{}: cannot open for appending metrics", path_.string()));
}

MESHTORCH_DECL void MetricsFile::append(const nlohmann::ordered_json& record) {
  if (!out_.is_open()) return;
  out_ << record.dump() << '\n';
  out_.flush();
  if (!out_)
    throw DataError(fmt::format("{}: writing metrics failed ({}) at global_step {}", path_.string(),
                                std::strerror(errno), record.value("global_step", std::int64_t{-1})));
}

MESHTORCH_DECL std::size_t MetricsFile::set_aside_after(std::int64_t step) {
  // Only a regular file can be rewritten (metrics.jsonl may be a link to a device).
  if (!out_.is_open() || !std::filesystem::is_regular_file(path_)) return 0;
  std::string kept, later, line;
  std::size_t count = 0;
  {
    std::ifstream in(path_);
    while (std::getline(in, line)) {
      const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      const bool after = record.is_object() && record.value("global_step", std::int64_t{-1}) > step;
      (after ? later : kept) += line + "\n";
      count += after;
    }
  }
  if (count == 0) return 0;
  out_.close();
  write_file(path_.parent_path() / discarded_name, later, std::ios::app);
  const auto replacement = std::filesystem::path(path_.string() + ".partial");
  write_file(replacement, kept, std::ios::trunc);
  std::filesystem::rename(replacement, path_);
  out_.open(path_, std::ios::app);
  if (!out_) throw DataError(fmt::format("{}: cannot open for appending metrics", path_.string()));
  return count;
}

MESHTORCH_DECL std::string format_metrics(const nlohmann::ordered_json& record) {
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

MESHTORCH_DECL nlohmann::ordered_json LogWindow::record(const TrainState& state, std::int64_t steps_per_epoch,
                                                        double lr, const PhaseTimers& timers) const {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double steps = static_cast<double>(state.running_steps);
  nlohmann::ordered_json record{
      {"global_step", state.global_step},
      {"lr", lr},
      {"running_loss", state.running_loss / steps},
      {"epoch", state.epoch},
      {"epoch_progress", static_cast<double>(state.epoch_step) / static_cast<double>(steps_per_epoch)},
      {"num_batches_remaining", steps_per_epoch - state.epoch_step},
      {"tokens_per_s", static_cast<double>(tokens_per_step_) * steps / seconds},
      {"time/total", 1000 * seconds / steps}};
  if (state.grad_norm >= 0) record["grad_norm"] = state.grad_norm;
  for (const auto& [phase, total] : timers.totals()) record["time/" + phase] = 1000 * total / steps;
  for (const auto& [key, value] : memory_figures(device_)) record[key] = value;
  return record;
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
