#pragma once
// Checkpoints of a 2D run (FSDP over one axis, tensor parallel over the other):
//
//   <exp>/ckpt-<step>/config.json, model.safetensors   rank 0: full weights (gathered over FSDP,
//                                                      then over TP), loadable by 01-single-gpu,
//                                                      transformers, and any mesh
//                     state.json                        rank 0
//                     optimizer-rank<R>-of<W>.safetensors every rank: AdamW state of its rows of
//                                                      its TP piece, and the RNG
//
// Weights resume into any mesh whose TP size divides the model; optimizer state on the same
// world size and TP size. Gathering the full weights on every rank for the save keeps this
// simple and bounds it by one rank's host memory: fine up to models that fit in CPU memory,
// where the per-rank sharded format of parallel/fsdp_checkpoint.hpp is the one to use beyond.
// The writes follow parallel/checkpoint.hpp: a .partial folder, barriers, rank 0 publishes.
#include <filesystem>
#include <optional>
#include <string>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/parallel/checkpoint.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/checkpoint.hpp>

namespace meshtorch::parallel {

// The full weights of a 2D-sharded model, on the CPU: a collective over both axes.
template <class PlanT>
io::NamedTensors gather_full_weights(const TensorParallel<PlanT>& tp, const FullyShardedDataParallel& fsdp) {
  const auto& group = tp.group();
  const torch::Device device = group.device() == comm::Device::cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  io::NamedTensors full;
  for (auto& [name, piece] : fsdp.full_state_dict()) {  // this rank's TP piece, whole over FSDP
    const auto dim = tp.shard_dim(name);
    full.emplace_back(name, dim ? comm::all_gather(group, piece.to(device), *dim).to(torch::kCPU) : piece);
  }
  return full;
}

template <class PlanT>
void save_checkpoint(const std::filesystem::path& exp_dir, const TensorParallel<PlanT>& tp,
                     const FullyShardedDataParallel& fsdp, const llama::Config& config, const train::AdamW& optimizer,
                     const train::TrainState& state, const train::RunIdentity& identity, const comm::AxisGroup& world) {
  const std::string name = train::checkpoint_name(state.global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  const auto full = gather_full_weights(tp, fsdp);
  on_rank_zero(world, [&] {
    std::filesystem::remove_all(partial_dir);
    std::filesystem::create_directories(partial_dir);
  });
  auto optimizer_state = optimizer.state();
  for (auto& rng : train::capture_rng_states()) optimizer_state.push_back(std::move(rng));
  io::save_safetensors(partial_dir / optimizer_shard_name(world.rank(), world.size()), optimizer_state);
  comm::barrier(world);
  on_rank_zero(world, [&] {
    llama::save_pretrained(config, full, partial_dir);
    io::write_file_atomically(partial_dir / "state.json", train::to_json(state, identity).dump(2) + "\n");
    train::publish_checkpoint(exp_dir, name);
  });
}

template <class PlanT>
std::optional<train::TrainState> load_checkpoint(const std::filesystem::path& exp_dir, const TensorParallel<PlanT>& tp,
                                                 FullyShardedDataParallel& fsdp, train::AdamW& optimizer,
                                                 const train::RunIdentity& identity, const comm::AxisGroup& world) {
  const auto found = checkpoint_to_resume(exp_dir, world);
  if (!found) return std::nullopt;
  const auto& resolved = *found;
  const train::TrainState state = train::read_train_state(resolved, identity);
  const auto weights_file = resolved / "model.safetensors";
  auto weights = io::load_safetensors(weights_file);
  io::NamedTensors pieces;
  for (auto& [name, full] : weights.tensors) pieces.emplace_back(name, tp.shard_of(name, full));
  fsdp.load_full_state_dict(pieces, weights_file.string());
  const auto file = resolved / optimizer_shard_name(world.rank(), world.size());
  if (!std::filesystem::exists(file))
    throw ConfigError(file.string() + " is missing: optimizer state is saved per rank and resumes on the same number "
                      "of ranks and TP size (" + std::to_string(world.size()) + " ranks, TP " +
                      std::to_string(tp.group().size()) + " here); the weights alone load on any mesh through -m " +
                      resolved.string());
  auto contents = io::load_safetensors(file);
  optimizer.load_state(contents, file.string());
  train::restore_rng_states(contents, file);
  comm::barrier(world);
  return state;
}

}  // namespace meshtorch::parallel
