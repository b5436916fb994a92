#pragma once
// Log lines in the guide's format: "[time] [rank=R] [LEVEL] message", so per-rank logs of a
// cluster run can be merged and sorted. A progress bar is drawn on rank 0 only, and only on a
// terminal (logs stay clean when redirected).
#include <cstdint>
#include <cstdio>
#include <string>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

MESHTORCH_DECL std::string timestamp();

class Logger {
 public:
  explicit Logger(int rank = 0) : rank_(rank) {}
  int rank() const { return rank_; }

  void info(const std::string& message) const { write("INFO", message); }
  void warning(const std::string& message) const { write("WARNING", message); }
  void error(const std::string& message) const { write("ERROR", message); }

 private:
  // A log that cannot be written (a full disk under a redirected stdout) ends the run: a run
  // whose log is lost cannot be diagnosed later.
  MESHTORCH_DECL void write(const char* level, const std::string& message) const;
  int rank_;
};

class ProgressBar {
 public:
  MESHTORCH_DECL ProgressBar(std::int64_t total, bool enabled);
  ~ProgressBar() {
    if (enabled_) std::fputs("\n", stderr);
  }
  MESHTORCH_DECL void update(std::int64_t done, const std::string& suffix = {});

 private:
  std::int64_t total_;
  bool enabled_;
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>

#include <fmt/format.h>

namespace meshtorch::train {

MESHTORCH_DECL std::string timestamp() {
  const auto now = std::chrono::system_clock::now();
  const auto t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%d %H:%M:%S", &tm);
  char with_ms[40];
  std::snprintf(with_ms, sizeof with_ms, "%s,%03d", buffer, static_cast<int>(ms));
  return with_ms;
}

MESHTORCH_DECL void Logger::write(const char* level, const std::string& message) const {
  if (std::fprintf(stdout, "[%s] [rank=%d] [%s] %s\n", timestamp().c_str(), rank_, level, message.c_str()) < 0 ||
      std::fflush(stdout) != 0)
    throw DataError(fmt::format("rank {}: writing the log to stdout failed ({}); the line was: {}", rank_,
                                std::strerror(errno), message));
}

MESHTORCH_DECL ProgressBar::ProgressBar(std::int64_t total, bool enabled)
    : total_(total), enabled_(enabled && ::isatty(STDERR_FILENO)) {}

MESHTORCH_DECL void ProgressBar::update(std::int64_t done, const std::string& suffix) {
  if (!enabled_ || total_ <= 0) return;
  constexpr int width = 30;
  const int filled = static_cast<int>(width * done / total_);
  std::fprintf(stderr, "\r%3d%%|%s%s| %lld/%lld %s", static_cast<int>(100 * done / total_),
               std::string(filled, '#').c_str(), std::string(width - filled, ' ').c_str(), static_cast<long long>(done),
               static_cast<long long>(total_), suffix.c_str());
  std::fflush(stderr);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
