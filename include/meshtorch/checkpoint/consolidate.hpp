#pragma once
// A sharded checkpoint turned into a Hugging Face folder, in one process and one tensor's memory.
#include <cstdint>
#include <filesystem>
#include <vector>

#include <meshtorch/checkpoint/manifest.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::checkpoint {

// What consolidate_sharded_checkpoint wrote.
struct ConsolidateResult {
  std::vector<std::filesystem::path> files;
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
MESHTORCH_DECL ConsolidateResult consolidate_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                                const std::filesystem::path& out_dir,
                                                                const ConsolidateOptions& options = {});

}  // namespace meshtorch::checkpoint

#if MESHTORCH_DEFINES(programs)
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/checkpoint/load.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/safetensors_writer.hpp>

namespace meshtorch::checkpoint {

MESHTORCH_DECL ConsolidateResult consolidate_sharded_checkpoint(const std::filesystem::path& checkpoint_dir,
                                                                const std::filesystem::path& out_dir,
                                                                const ConsolidateOptions& options) {
  using namespace detail;
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
  return result;
}

}  // namespace meshtorch::checkpoint
#endif  // MESHTORCH_DEFINES(programs)
