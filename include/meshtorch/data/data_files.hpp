#pragma once
// What -d/--dataset-name (and --dataset-subset) name, as a list of files: one file, a folder
// (every .txt/.jsonl/.json file below it, or every llm.c .bin file, in path order), or a glob
// pattern. `--dataset-subset NAME` picks the folder's subfolder NAME, as an HF data set's
// configuration name picks its files. Files of other kinds in a folder are listed, never read
// silently: the caller logs them.
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

enum class DataFormat { text, jsonl, llmc_tokens };

inline DataFormat data_format_of(const std::filesystem::path& path) {
  const auto ext = path.extension().string();
  if (ext == ".jsonl" || ext == ".json") return DataFormat::jsonl;
  if (ext == ".bin") return DataFormat::llmc_tokens;
  return DataFormat::text;
}

struct DataFiles {
  std::vector<std::filesystem::path> files;    // in the order their documents are read
  DataFormat format = DataFormat::text;        // of the folder or pattern; a text-or-JSONL mix reads as each file's own
  bool tokenized = false;                      // llm.c .bin files: ids, not text
  std::filesystem::path root;                  // the folder the token cache goes beside by default
  std::vector<std::filesystem::path> ignored;  // files in a folder that are neither text, JSONL nor .bin
};

namespace data_files_detail {

// The cache and hidden files (.git, editor swap files) are not data.
inline bool hidden(const std::filesystem::path& path) {
  const auto name = path.filename().string();
  return !name.empty() && name.front() == '.';
}

inline bool has_glob_characters(std::string_view text) { return text.find_first_of("*?[") != std::string_view::npos; }

inline bool readable_kind(const std::filesystem::path& path) {
  const auto ext = path.extension().string();
  return ext == ".txt" || ext == ".text" || ext == ".jsonl" || ext == ".json" || ext == ".bin";
}

// Text and JSONL may be mixed (each file read as its own kind); .bin ids may not be mixed with text.
MESHTORCH_DECL DataFiles classify(std::vector<std::filesystem::path> files, std::filesystem::path root,
                                  const std::string& what);

MESHTORCH_DECL std::vector<std::string> subfolders(const std::filesystem::path& dir);

}  // namespace data_files_detail

// The files of `name` ('builtin' is the caller's: it has no files). Throws DataError naming what
// is missing: no file, folder or match; a subset that is not a subfolder (with the ones there are).
MESHTORCH_DECL DataFiles resolve_data_files(const std::string& name, const std::string& subset = {});

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(core)
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <glob.h>

namespace meshtorch::data {

namespace data_files_detail {

MESHTORCH_DECL DataFiles classify(std::vector<std::filesystem::path> files, std::filesystem::path root,
                                  const std::string& what) {
  DataFiles result;
  result.root = std::move(root);
  const auto bins =
      std::ranges::count_if(files, [](const auto& f) { return data_format_of(f) == DataFormat::llmc_tokens; });
  if (bins != 0 && bins != static_cast<std::ptrdiff_t>(files.size()))
    throw DataError(
        fmt::format("{}: mixes {} llm.c .bin token file(s) with {} text/JSONL file(s); the .bin files hold "
                    "ids of their own tokenizer, so give them as a data set of their own",
                    what, bins, files.size() - static_cast<std::size_t>(bins)));
  result.tokenized = bins != 0;
  result.format = files.empty() ? DataFormat::text : data_format_of(files.front());
  result.files = std::move(files);
  return result;
}

MESHTORCH_DECL std::vector<std::string> subfolders(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.is_directory() && !hidden(entry.path())) names.push_back(entry.path().filename().string());
  std::ranges::sort(names);
  return names;
}

}  // namespace data_files_detail

MESHTORCH_DECL DataFiles resolve_data_files(const std::string& name, const std::string& subset) {
  namespace fs = std::filesystem;
  using namespace data_files_detail;
  std::error_code error;
  if (!subset.empty()) {
    if (!fs::is_directory(name, error))
      throw DataError(
          fmt::format("--dataset-subset '{}' needs -d/--dataset-name to be a folder whose subfolders are "
                      "the subsets; '{}' is not a folder",
                      subset, name));
    const auto dir = fs::path(name) / subset;
    if (!fs::is_directory(dir, error))
      throw DataError(fmt::format("--dataset-subset '{}': {} has no such subfolder (its subsets: {})", subset, name,
                                  fmt::join(subfolders(name), ", ")));
    return resolve_data_files(dir.string());
  }
  if (fs::is_regular_file(name, error)) {
    const fs::path path(name);
    return classify({path}, path.parent_path().empty() ? fs::path(".") : path.parent_path(), name);
  }
  if (fs::is_directory(name, error)) {
    std::vector<fs::path> files, ignored;
    for (auto it = fs::recursive_directory_iterator(name, fs::directory_options::follow_directory_symlink);
         it != fs::recursive_directory_iterator(); ++it) {
      if (hidden(it->path())) {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file()) continue;
      (readable_kind(it->path()) ? files : ignored).push_back(it->path());
    }
    std::ranges::sort(files);
    std::ranges::sort(ignored);
    if (files.empty())
      throw DataError(fmt::format("-d/--dataset-name '{}': the folder holds no .txt, .jsonl, .json or .bin file{}",
                                  name, ignored.empty() ? "" : fmt::format(" ({} other file(s))", ignored.size())));
    auto result = classify(std::move(files), name, name);
    result.ignored = std::move(ignored);
    return result;
  }
  if (fs::exists(name, error))
    throw DataError(
        fmt::format("-d/--dataset-name '{}' is neither a regular file nor a folder (a device or pipe)", name));
  if (has_glob_characters(name)) {
    // POSIX glob(3) rather than a hand-written matcher: the shell's own rules for * ? [...].
    glob_t matches{};
    const int status = ::glob(name.c_str(), GLOB_ERR, nullptr, &matches);
    std::vector<fs::path> files;
    for (std::size_t i = 0; status == 0 && i < matches.gl_pathc; ++i)
      if (fs::is_regular_file(matches.gl_pathv[i], error)) files.emplace_back(matches.gl_pathv[i]);
    ::globfree(&matches);
    if (files.empty()) throw DataError(fmt::format("-d/--dataset-name '{}': the pattern matches no file", name));
    std::ranges::sort(files);
    const auto root = files.front().parent_path().empty() ? fs::path(".") : files.front().parent_path();
    return classify(std::move(files), root, name);
  }
  throw DataError(
      fmt::format("-d/--dataset-name '{}' is neither 'builtin', an existing file or folder, nor a pattern "
                  "that matches files",
                  name));
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(core)
