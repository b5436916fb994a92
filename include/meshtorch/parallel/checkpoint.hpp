#pragma once
// Checkpoints of a data-parallel run, in the single-process format (train/checkpoint.hpp) plus
// per-rank optimizer shards:
//
//   <exp>/ckpt-<step>/config.json, model.safetensors   rank 0 (all replicas are equal)
//                     state.json                        rank 0
//                     optimizer.safetensors             rank 0, for a replicated AdamW
//                     optimizer-rank<R>-of<W>.safetensors  every rank, for ZeroRedundancyOptimizer
//
// Barriers order the steps: rank 0 creates the folder, every rank writes its files, rank 0
// publishes (rename + symlink swap), so a crash at any point leaves the previous checkpoint
// loadable. Each rank saves its own shard, so saving scales with the world and needs no
// gather; a sharded checkpoint resumes on the same number of ranks (the error says so). The
// folder must be on storage every rank sees (one node, or a shared file system).
#include <filesystem>
#include <optional>
#include <string>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/parallel/zero.hpp>
#include <meshtorch/train/checkpoint.hpp>

namespace meshtorch::parallel {

template <class Optimizer>
constexpr bool is_sharded_optimizer = std::is_same_v<Optimizer, ZeroRedundancyOptimizer>;

inline std::string optimizer_shard_name(int rank, int world_size) {
  return "optimizer-rank" + std::to_string(rank) + "-of" + std::to_string(world_size) + ".safetensors";
}

// The checkpoint folder every rank of `group` resumes from, or nothing: rank 0's view decides,
// so ranks never disagree about resuming; the link is resolved once, so a faster rank's next
// save cannot swap it mid-load. The decision is CPU metadata: it travels over the group's CPU
// companion, whatever the mesh's device.
inline std::optional<std::filesystem::path> checkpoint_to_resume(const std::filesystem::path& exp_dir,
                                                                 const comm::AxisGroup& group) {
  const auto dir = train::latest_checkpoint(exp_dir);
  if (!comm::broadcast_value(group, std::filesystem::exists(dir / "state.json"), 0)) return std::nullopt;
  return std::filesystem::canonical(dir);
}

template <class Optimizer>
void save_checkpoint(const std::filesystem::path& exp_dir, llama::LlamaForCausalLM& model, const Optimizer& optimizer,
                     const train::TrainState& state, const train::RunIdentity& identity,
                     const comm::AxisGroup& group) {
  const std::string name = train::checkpoint_name(state.global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  on_rank_zero(group, [&] {
    std::filesystem::remove_all(partial_dir);
    std::filesystem::create_directories(partial_dir);
  });
  auto optimizer_state = optimizer.state();
  for (auto& rng : train::capture_rng_states()) optimizer_state.push_back(std::move(rng));
  if constexpr (is_sharded_optimizer<Optimizer>)
    io::save_safetensors(partial_dir / optimizer_shard_name(group.rank(), group.size()), optimizer_state);
  comm::barrier(group);  // every shard is on disk before rank 0 publishes the folder
  on_rank_zero(group, [&] {
    if constexpr (!is_sharded_optimizer<Optimizer>) io::save_safetensors(partial_dir / "optimizer.safetensors", optimizer_state);
    llama::save_pretrained(model, partial_dir);
    io::write_file_atomically(partial_dir / "state.json", train::to_json(state, identity).dump(2) + "\n");
    train::publish_checkpoint(exp_dir, name);
  });
}

// Restores model, optimizer (this rank's shard for ZeRO) and RNG on every rank from
// <exp>/checkpoint if it exists, and returns the state.
template <class Optimizer>
std::optional<train::TrainState> load_checkpoint(const std::filesystem::path& exp_dir, llama::LlamaForCausalLM& model,
                                                 Optimizer& optimizer, const train::RunIdentity& identity,
                                                 const comm::AxisGroup& group) {
  const auto found = checkpoint_to_resume(exp_dir, group);
  if (!found) return std::nullopt;
  const auto& resolved = *found;
  const train::TrainState state = train::read_train_state(resolved, identity);
  llama::load_pretrained_weights(model, resolved);
  std::filesystem::path file = resolved / "optimizer.safetensors";
  if constexpr (is_sharded_optimizer<Optimizer>) {
    file = resolved / optimizer_shard_name(group.rank(), group.size());
    if (!std::filesystem::exists(file)) {
      std::string found;
      for (const auto& entry : std::filesystem::directory_iterator(resolved))
        if (entry.path().filename().string().rfind("optimizer", 0) == 0)
          found += (found.empty() ? "" : ", ") + entry.path().filename().string();
      throw ConfigError(file.string() + " is missing: ZeroRedundancyOptimizer state is saved per rank and resumes "
                        "on the same number of ranks (" + std::to_string(group.size()) + " here); the folder holds: " +
                        (found.empty() ? std::string("no optimizer state") : found));
    }
  } else if (!std::filesystem::exists(file)) {
    throw ConfigError(file.string() + " is missing (was the checkpoint written with ZeroRedundancyOptimizer? then "
                      "resume with it)");
  }
  auto contents = io::load_safetensors(file);
  optimizer.load_state(contents, file.string());
  train::restore_rng_states(contents, file);
  comm::barrier(group);
  return state;
}

}  // namespace meshtorch::parallel
