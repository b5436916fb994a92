// meshtorch-diagnose DIR: reads every rank's flight recorder dump (rank_<N>.json, written by the
// watchdog on a timeout, on a fatal signal or on request) under DIR and names the first
// divergence between ranks or the rank that stopped, with each rank's last collectives.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/diagnostics/hang_analysis.hpp>

namespace fs = std::filesystem;
namespace mc = meshtorch::diagnostics;

namespace {

// rank_<N>.json files anywhere under `dir` (a meshrun log folder holds them one level down).
std::vector<nlohmann::json> read_dumps(const fs::path& dir, std::vector<std::string>& problems) {
  std::vector<nlohmann::json> dumps;
  const std::regex name(R"(rank_[0-9]+\.json)");
  std::vector<fs::path> files;
  if (fs::is_regular_file(dir)) {
    files.push_back(dir);
  } else {
    for (const auto& entry : fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied))
      if (entry.is_regular_file() && std::regex_match(entry.path().filename().string(), name))
        files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    std::ifstream in(file);
    auto dump = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (dump.is_discarded() || !dump.is_object() || dump.value("format", "") != "meshtorch-flight-recorder") {
      problems.push_back(fmt::format("{} is not a meshtorch flight recorder dump; skipped", file.string()));
      continue;
    }
    dump["file"] = file.string();
    dumps.push_back(std::move(dump));
  }
  return dumps;
}

// One ring entry, with its tensor's shape and dtype: a collective whose size differs between
// ranks (a desync the backend itself catches) shows here.
std::string describe(const nlohmann::json& entry) {
  const std::string detail = entry.value("detail", "");
  std::string tensor;
  if (entry.contains("shape") && entry["shape"].is_array())
    tensor = fmt::format(" {} {}", entry["shape"].dump(), entry.value("dtype", ""));
  return fmt::format("{} #{} over the {}{} ({}){}", entry.value("op", "?"), entry.value("seq", 0),
                     entry.value("group", "?"), tensor, entry.value("state", "?"), detail.empty() ? "" : ": " + detail);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int last = 3;
  bool json = false;
  CLI::App app{
      "meshtorch-diagnose DIR: reads the flight recorder dumps of every rank (rank_<N>.json under DIR: "
      "MESHTORCH_FLIGHT_RECORDER_DIR, <save-dir>/<experiment>/flight_recorder, or the folder a timed-out rank "
      "printed) and names the first divergence between ranks (\"rank 3 is in all_gather #812 over the FSDP group "
      "... while ranks 0, 1, 2 are in reduce_scatter #812\") or the rank that stopped and its last collective.\n\n"
      "A rank that stopped (SIGSTOP, a hung kernel) writes no dump; what it last published through the store is in "
      "the dumps of the ranks that waited for it. Exit code: 0 when a culprit is named, 1 when none is, 2 when no "
      "dump was found.",
      "meshtorch-diagnose"};
  app.add_option("dir", dir, "folder holding the dumps (searched recursively), or one dump")->required();
  app.add_option("--last", last, "collectives to list per rank")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_flag("--json", json, "print the verdict as JSON");
  CLI11_PARSE(app, argc, argv);

  std::vector<std::string> problems;
  std::vector<nlohmann::json> dumps;
  try {
    dumps = read_dumps(dir, problems);
  } catch (const std::exception& e) {
    std::cerr << "meshtorch-diagnose: " << e.what() << "\n";
    return 2;
  }
  for (const auto& problem : problems) std::cerr << "meshtorch-diagnose: " << problem << "\n";
  if (dumps.empty()) {
    std::cerr << fmt::format("meshtorch-diagnose: no flight recorder dump (rank_<N>.json) under {}\n", dir);
    return 2;
  }
  int world_size = 0;
  std::vector<int> dumped;
  for (const auto& dump : dumps) {
    world_size = std::max(world_size, dump.value("world_size", 0));
    dumped.push_back(dump.value("rank", -1));
  }
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r)
    if (std::find(dumped.begin(), dumped.end(), r) == dumped.end()) missing.push_back(r);

  const auto reports = mc::rank_reports_from_dumps(dumps);
  const auto verdict = mc::analyse_hang(reports);
  if (json) {
    std::cout << nlohmann::json{{"culprits", verdict.culprits},
                                {"summary", verdict.summary},
                                {"details", verdict.details},
                                {"dumped", dumped},
                                {"missing", missing}}
                     .dump(1)
              << "\n";
    return verdict.culprits.empty() ? 1 : 0;
  }
  std::cout << fmt::format("dumps of {} of {} ranks ({}){}\n", dumped.size(), world_size, fmt::join(dumped, ", "),
                           missing.empty() ? "" : fmt::format("; no dump from rank(s) {}", fmt::join(missing, ", ")));
  std::cout << "culprit: " << verdict.text() << "\n";
  for (const auto& dump : dumps) {
    std::cout << fmt::format("rank {} ({}, pid {}): dumped on {}\n", dump.value("rank", -1), dump.value("host", "?"),
                             dump.value("pid", 0), dump.value("reason", "?"));
    const auto& entries = dump.value("entries", nlohmann::json::array());
    const std::size_t from = entries.size() > static_cast<std::size_t>(last) ? entries.size() - last : 0;
    for (std::size_t i = from; i < entries.size(); ++i) std::cout << "  " << describe(entries[i]) << "\n";
  }
  return verdict.culprits.empty() ? 1 : 0;
}
