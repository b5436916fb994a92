#pragma once
// Sharded checkpoints of a FullyShardedDataParallel run: every rank writes its own rows, so no
// rank ever holds the whole model, and saving scales with the world.
//
//   <exp>/ckpt-<step>/config.json                         rank 0
//                     state.json                          rank 0
//                     model-rank<R>-of<W>.safetensors     every rank: its rows of every weight,
//                                                         named as the full weight
//                     optimizer-rank<R>-of<W>.safetensors every rank: AdamW state of its rows, RNG
//
// A checkpoint resumes on the same number of ranks (the error says so otherwise).
// consolidate_checkpoint joins the rank files, row blocks in rank order, into one HF folder
// (config.json + model.safetensors) that 01-single-gpu, load_pretrained_weights and
// transformers' from_pretrained read: the offline counterpart of gathering a full state dict.
// Writes follow parallel/checkpoint.hpp: a .partial folder, barriers, rank 0 publishes, so a
// crash at any point leaves the previous checkpoint loadable.
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <string>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/parallel/checkpoint.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/checkpoint.hpp>

namespace meshtorch::parallel {

inline std::string model_shard_name(int rank, int world_size) {
  return "model-rank" + std::to_string(rank) + "-of" + std::to_string(world_size) + ".safetensors";
}

inline void save_sharded_checkpoint(const std::filesystem::path& exp_dir, const llama::Config& config,
                                    const FullyShardedDataParallel& fsdp, const train::AdamW& optimizer,
                                    const train::TrainState& state, const train::RunIdentity& identity) {
  const auto& group = fsdp.group();
  const std::string name = train::checkpoint_name(state.global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  on_rank_zero(group, [&] {
    std::filesystem::remove_all(partial_dir);
    std::filesystem::create_directories(partial_dir);
  });
  const std::map<std::string, std::string> metadata{{"format", "pt"},
                                                    {"fsdp_rank", std::to_string(group.rank())},
                                                    {"fsdp_world_size", std::to_string(group.size())}};
  io::save_safetensors(partial_dir / model_shard_name(group.rank(), group.size()), fsdp.sharded_state_dict(), metadata);
  auto optimizer_state = optimizer.state();
  for (auto& rng : train::capture_rng_states()) optimizer_state.push_back(std::move(rng));
  io::save_safetensors(partial_dir / optimizer_shard_name(group.rank(), group.size()), optimizer_state, metadata);
  comm::barrier(group);  // every rank's files are on disk before rank 0 publishes the folder
  on_rank_zero(group, [&] {
    const auto dtype = fsdp.units().front()->shard_dtype();
    io::write_file_atomically(partial_dir / "config.json", llama::config_to_json(config, llama::dtype_name(dtype)).dump(2) + "\n");
    io::write_file_atomically(partial_dir / "state.json", train::to_json(state, identity).dump(2) + "\n");
    train::publish_checkpoint(exp_dir, name);
  });
}

// Restores this rank's shards, optimizer state and RNG from <exp>/checkpoint if it exists, and
// returns the state.
inline std::optional<train::TrainState> load_sharded_checkpoint(const std::filesystem::path& exp_dir,
                                                                FullyShardedDataParallel& fsdp, train::AdamW& optimizer,
                                                                const train::RunIdentity& identity) {
  const auto& group = fsdp.group();
  const auto found = checkpoint_to_resume(exp_dir, group);
  if (!found) return std::nullopt;
  const auto& resolved = *found;
  const train::TrainState state = train::read_train_state(resolved, identity);
  const auto model_file = resolved / model_shard_name(group.rank(), group.size());
  if (!std::filesystem::exists(model_file)) {
    std::string found;
    for (const auto& entry : std::filesystem::directory_iterator(resolved))
      if (entry.path().filename().string().rfind("model-rank", 0) == 0)
        found += (found.empty() ? "" : ", ") + entry.path().filename().string();
    throw ConfigError(model_file.string() + " is missing on rank " + std::to_string(group.global_rank()) +
                      ": a sharded checkpoint resumes on the same number of ranks (" + std::to_string(group.size()) +
                      " here); the folder holds: " + (found.empty() ? std::string("no model shards") : found) +
                      ". consolidate_checkpoint turns it into one HF folder that any world size can load.");
  }
  fsdp.load_sharded_state_dict(io::load_safetensors(model_file), model_file.string());
  const auto optimizer_file = resolved / optimizer_shard_name(group.rank(), group.size());
  auto contents = io::load_safetensors(optimizer_file);
  optimizer.load_state(contents, optimizer_file.string());
  train::restore_rng_states(contents, optimizer_file);
  comm::barrier(group);
  return state;
}

// Joins a sharded checkpoint folder's model-rank<R>-of<W>.safetensors into out_dir/
// model.safetensors (+ config.json): one process, no launcher. Holds the whole model in memory.
inline void consolidate_checkpoint(const std::filesystem::path& checkpoint_dir, const std::filesystem::path& out_dir) {
  namespace fs = std::filesystem;
  const std::regex pattern(R"(model-rank(\d+)-of(\d+)\.safetensors)");
  int world = 0;
  for (const auto& entry : fs::directory_iterator(checkpoint_dir)) {
    std::smatch match;
    const auto file = entry.path().filename().string();
    if (std::regex_match(file, match, pattern)) world = std::stoi(match[2]);
  }
  if (world == 0)
    throw DataError(checkpoint_dir.string() + ": no model-rank<R>-of<W>.safetensors files (is it a sharded checkpoint?)");
  std::vector<io::SafetensorsFile> ranks;
  for (int r = 0; r < world; ++r) {
    const auto file = checkpoint_dir / model_shard_name(r, world);
    if (!fs::exists(file)) throw DataError(file.string() + " is missing: the checkpoint was written by " + std::to_string(world) + " ranks");
    ranks.push_back(io::load_safetensors(file));
  }
  io::NamedTensors full;
  for (const auto& [name, first] : ranks.front().tensors) {
    std::vector<torch::Tensor> blocks;
    for (int r = 0; r < world; ++r) {
      const auto* block = ranks[r].find(name);
      const auto file = (checkpoint_dir / model_shard_name(r, world)).string();
      if (!block) throw DataError(file + ": tensor '" + name + "' is missing");
      if (block->sizes().slice(1) != first.sizes().slice(1))
        throw DataError(file + ": tensor '" + name + "' has shape " + c10::str(block->sizes()) + ", rank 0's block is " +
                        c10::str(first.sizes()) + "; only the first dimension may differ");
      blocks.push_back(*block);
    }
    full.emplace_back(name, torch::cat(blocks, 0));
  }
  fs::create_directories(out_dir);
  std::ifstream config_in(checkpoint_dir / "config.json");
  if (!config_in) throw DataError((checkpoint_dir / "config.json").string() + " is missing");
  const std::string config_text((std::istreambuf_iterator<char>(config_in)), std::istreambuf_iterator<char>());
  io::write_file_atomically(out_dir / "config.json", config_text);
  io::save_safetensors(out_dir / "model.safetensors", full, {{"format", "pt"}});
}

}  // namespace meshtorch::parallel
