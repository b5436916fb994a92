#pragma once
// A model folder is data, not a set of paths to anywhere: the files meshtorch reads from one
// (config.json, the weights, the index's shards) are named without '/' or '..' and, after
// following links, lie inside the folder (or in the Hugging Face cache's blobs of its snapshot).
// Checked before a file is opened, so that an index naming /etc/passwd or ../x reads nothing.
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

// Present even as a link that leads nowhere: such a file is an error, not a folder without weights.
inline bool present_in_folder(const std::filesystem::path& path) {
  std::error_code ignored;
  return std::filesystem::exists(std::filesystem::symlink_status(path, ignored));
}

// Which folder a file is confined to: a model folder may also read its Hugging Face cache blobs.
enum class FolderKind { model, checkpoint };

// The file `name` of the folder `dir`, which `named_by` names (the index's entry, a manifest's,
// or the folder's layout): a plain file name whose file, after following links, is a regular file
// the folder may read.
MESHTORCH_DECL std::filesystem::path confined_file(const std::filesystem::path& dir, const std::string& name,
                                                   const std::string& named_by, FolderKind kind);

inline std::filesystem::path model_file(const std::filesystem::path& dir, const std::string& name,
                                        const std::string& named_by) {
  return confined_file(dir, name, named_by, FolderKind::model);
}

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <algorithm>

#include <fmt/format.h>

namespace meshtorch::io {

namespace model_folder_detail {

namespace fs = std::filesystem;

inline bool lies_inside(const fs::path& target, const fs::path& folder) {
  const auto [folder_end, target_part] = std::mismatch(folder.begin(), folder.end(), target.begin(), target.end());
  return folder_end == folder.end() && target_part != target.end();
}

// Whether `target` (resolved) is a file the folder `dir` (resolved) may read: one inside it or,
// when `dir` is a snapshot of the Hugging Face cache (<repo>/snapshots/<revision>/, whose files
// are links to <repo>/blobs/<hash>), one in that repository's blobs folder, so that folders
// downloaded by huggingface_hub load where they lie.
inline bool allowed_target(const fs::path& target, const fs::path& dir) {
  if (lies_inside(target, dir)) return true;
  const auto snapshots = dir.parent_path();
  return snapshots.filename() == "snapshots" && target.parent_path() == snapshots.parent_path() / "blobs";
}

}  // namespace model_folder_detail

MESHTORCH_DECL std::filesystem::path confined_file(const std::filesystem::path& dir, const std::string& name,
                                                   const std::string& named_by, FolderKind kind) {
  namespace fs = std::filesystem;
  const std::string_view folder = kind == FolderKind::model ? "model folder" : "checkpoint folder";
  if (name.empty() || name == "." || name == ".." || name.find_first_of(std::string("/\\\0", 3)) != std::string::npos)
    throw DataError(
        fmt::format("{} is '{}', not a plain file name; a {}'s files must lie in the folder "
                    "itself, named without '/', '\\' or '..'",
                    named_by, name, folder));
  const fs::path path = dir / name;
  if (!present_in_folder(path))
    throw DataError(fmt::format("{} is '{}', which does not exist in {}", named_by, name, dir.string()));
  std::error_code error;
  const auto resolved_dir = fs::canonical(dir, error);
  if (error) throw DataError(fmt::format("{}: cannot resolve the folder ({})", dir.string(), error.message()));
  const auto target = fs::canonical(path, error);
  if (error)
    throw DataError(fmt::format("{} is '{}', a link that leads nowhere ({})", named_by, name, error.message()));
  const bool allowed = kind == FolderKind::model ? model_folder_detail::allowed_target(target, resolved_dir)
                                                 : model_folder_detail::lies_inside(target, resolved_dir);
  if (!allowed)
    throw DataError(fmt::format("{} is '{}', a link to {}, outside the {} {}; refused", named_by, name, target.string(),
                                folder, resolved_dir.string()));
  if (!fs::is_regular_file(target, error))
    throw DataError(fmt::format("{} is '{}', which is not a regular file", named_by, name));
  return path;
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
