#pragma once
// A sharded checkpoint turned into a Hugging Face folder, in one process and one tensor's memory.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <meshtorch/checkpoint/manifest.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::checkpoint {

// What consolidate_sharded_checkpoint wrote.
struct ConsolidateResult {
  std::vector<std::filesystem::path> files;
  std::vector<std::filesystem::path> removed;  // weight files of an earlier export this one replaced
  std::int64_t tensors = 0;
  std::uint64_t bytes = 0;  // of tensor data
};

struct ConsolidateOptions {
  std::uint64_t max_shard_bytes = std::uint64_t{5} << 30;  // transformers' default: 5 GB per file
  bool include_optimizer = false;
};

// Turns a sharded checkpoint into an HF folder: config.json (and the other extra files) copied,
// model.safetensors, or model-0000i-of-0000n.safetensors with model.safetensors.index.json beyond
// max_shard_bytes. One process, no launcher; assembles one full tensor at a time, written straight
// into the output file (whose header is planned from the manifest), so memory holds one tensor.
// `out_dir` may not lie inside a checkpoint or an experiment folder (a later save's clean-up, or a
// resume's search, would meet it). Weight files of an earlier export in `out_dir` that this one did
// not write are removed once the new ones are complete, as transformers' save_pretrained does: a
// loader would otherwise read an old model.safetensors beside the new shards.
MESHTORCH_DECL ConsolidateResult consolidate_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                                const std::filesystem::path& out_dir,
                                                                const ConsolidateOptions& options = {});

// A DataError when `out_dir` is, or lies inside, a checkpoint folder (it holds manifest.json, or
// is named ckpt-<step>) or an experiment folder (it holds the `checkpoint` link, a ckpt-<step>
// folder or metrics.jsonl).
MESHTORCH_DECL void check_export_folder(const std::filesystem::path& out_dir);

// Whether `file` is a name an HF export's weights take: model.safetensors, its index, or
// model-NNNNN-of-NNNNN.safetensors.
MESHTORCH_DECL bool is_export_weight_file(const std::string& file);

}  // namespace meshtorch::checkpoint

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <fstream>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/checkpoint/load.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/safetensors_writer.hpp>
#include <meshtorch/train/metrics.hpp>

namespace meshtorch::checkpoint {

MESHTORCH_DECL ConsolidateResult consolidate_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                                const std::filesystem::path& out_dir,
                                                                const ConsolidateOptions& options) {
  using namespace detail;
  check_export_folder(out_dir);
  const auto m = read_manifest(checkpoint_dir);
  verify_checkpoint_files(checkpoint_dir, m);
  if (!m.files.contains("config.json"))
    throw DataError(
        fmt::format("{}: no config.json was saved with the checkpoint (pass it in "
                    "SaveOptions::extra_files); an HF folder needs one",
                    checkpoint_dir.string()));
  std::vector<const TensorRecord*> model;
  for (const auto& t : m.tensors)
    if (options.include_optimizer || t.name.rfind(optimizer_prefix, 0) != 0) model.push_back(&t);
  if (model.empty()) throw DataError(fmt::format("{}: the checkpoint holds no model tensors", checkpoint_dir.string()));

  std::vector<std::vector<const TensorRecord*>> shards(1);
  std::uint64_t in_shard = 0, total = 0;
  for (const auto* t : model) {
    const auto bytes = io::safetensors_bytes(t->dtype, t->shape);
    if (in_shard > 0 && in_shard + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += bytes;
    total += bytes;
  }
  std::filesystem::create_directories(out_dir);
  ConsolidateResult result;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  Readers readers(checkpoint_dir);
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const auto file = shards.size() == 1 ? std::string("model.safetensors")
                                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    std::vector<io::SafetensorsEntry> entries;
    for (const auto* t : shards[s]) entries.push_back(io::SafetensorsEntry{t->name, t->dtype, t->shape});
    io::SafetensorsStreamWriter writer(out_dir / file, std::move(entries), {{"format", "pt"}});
    for (const auto* t : shards[s]) {
      auto full = torch::empty(t->shape, torch::TensorOptions().dtype(t->dtype));
      fill_from_pieces(*t, full, io::whole(t->shape), readers);
      writer.append(full);
      weight_map[t->name] = file;
      ++result.tensors;
    }
    writer.commit();
    result.files.push_back(out_dir / file);
  }
  result.bytes = total;
  if (shards.size() > 1) {
    const nlohmann::ordered_json index{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    io::write_file_atomically(out_dir / "model.safetensors.index.json", index.dump(2) + "\n");
    result.files.push_back(out_dir / "model.safetensors.index.json");
  }
  for (const auto& [file, digest] : m.files) {
    const bool rank_file = file.rfind("rank", 0) == 0 && file.ends_with(".safetensors");
    if (rank_file || file == state_file_name) continue;
    // Small files (config.json, ...) whose size and checksum were verified above.
    std::ifstream in(checkpoint_file(checkpoint_dir, file), std::ios::binary);
    std::string contents(digest.bytes, '\0');
    in.read(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!in) throw DataError(fmt::format("{}: could not be read whole", (checkpoint_dir / file).string()));
    io::write_file_atomically(out_dir / file, contents);
    result.files.push_back(out_dir / file);
  }
  // Only now, with every new file complete: an earlier export's weights that this one replaced.
  std::set<std::filesystem::path> written(result.files.begin(), result.files.end());
  for (const auto& entry : std::filesystem::directory_iterator(out_dir)) {
    if (!is_export_weight_file(entry.path().filename().string()) || written.contains(entry.path())) continue;
    std::filesystem::remove(entry.path());
    result.removed.push_back(entry.path());
  }
  std::sort(result.removed.begin(), result.removed.end());
  return result;
}

MESHTORCH_DECL void check_export_folder(const std::filesystem::path& out_dir) {
  namespace fs = std::filesystem;
  // ckpt-<step>, .partial or .replaced: the names a save gives (a folder "ckpt-old" is the user's).
  auto is_checkpoint_name = [](const fs::path& p) {
    const auto name = p.filename().string();
    return name.starts_with("ckpt-") && name.size() > 5 && name[5] >= '0' && name[5] <= '9';
  };
  auto holds = [](const fs::path& folder, const auto& name) {
    std::error_code error;
    return fs::exists(fs::symlink_status(folder / name, error));
  };
  auto holds_checkpoint_folder = [&](const fs::path& folder) {
    std::error_code error;
    for (fs::directory_iterator it(folder, error), end; !error && it != end; it.increment(error))
      if (is_checkpoint_name(it->path()) && it->is_directory(error)) return true;
    return false;
  };
  // The outermost such folder: the message's suggestion then lies outside all of them.
  const auto target = fs::weakly_canonical(fs::absolute(out_dir));
  std::optional<std::pair<fs::path, std::string_view>> outermost;
  for (auto folder = target;; folder = folder.parent_path()) {
    if (is_checkpoint_name(folder) || holds(folder, manifest_file_name))
      outermost.emplace(folder, "a checkpoint folder");
    else if (holds(folder, checkpoint_link_name) || holds(folder, train::MetricsFile::file_name) ||
             holds_checkpoint_folder(folder))
      outermost.emplace(folder, "an experiment folder");
    if (folder == folder.parent_path()) break;
  }
  if (!outermost) return;
  const auto& [folder, kind] = *outermost;
  throw DataError(
      fmt::format("{}: an export may not lie {} {} ({}): a later save's clean-up or a resume would meet it; "
                  "export outside it, e.g. to {}",
                  out_dir.string(), folder == target ? "in" : "inside", kind, folder.string(),
                  (folder.parent_path() / (folder.filename().string() + "-hf")).string()));
}

MESHTORCH_DECL bool is_export_weight_file(const std::string& file) {
  if (file == "model.safetensors" || file == "model.safetensors.index.json") return true;
  // model-00001-of-00004.safetensors: the names transformers and this consolidation give shards.
  constexpr std::string_view prefix = "model-", middle = "-of-", suffix = ".safetensors";
  if (!file.starts_with(prefix) || !file.ends_with(suffix)) return false;
  const std::string_view numbers(file.data() + prefix.size(), file.size() - prefix.size() - suffix.size());
  const auto split = numbers.find(middle);
  auto digits = [](std::string_view text) {
    return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return split != std::string_view::npos && digits(numbers.substr(0, split)) &&
         digits(numbers.substr(split + middle.size()));
}

}  // namespace meshtorch::checkpoint
#endif  // MESHTORCH_DEFINES(programs)
