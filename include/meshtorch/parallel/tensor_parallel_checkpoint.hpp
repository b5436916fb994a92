#pragma once
// Checkpoints of a tensor-parallel (optionally data-parallel) run:
//
//   <exp>/ckpt-<step>/config.json, model.safetensors   rank 0: full weights, gathered over TP, so
//                                                      01-single-gpu and transformers load them
//                     state.json                        rank 0
//                     optimizer-tp<R>-of<T>.safetensors the ranks at DP coordinate 0: TP rank R's
//                                                      AdamW state for its shards (the DP replicas
//                                                      hold the same)
//
// Weights resume into any TP size that divides the model (each rank cuts its piece from the full
// tensors); optimizer state resumes on the same TP size and any DP size. The same barriers as
// parallel/checkpoint.hpp order the writes, so a crash leaves the previous checkpoint loadable.
#include <filesystem>
#include <optional>
#include <string>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/parallel/checkpoint.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/checkpoint.hpp>

namespace meshtorch::parallel {

inline std::string tp_optimizer_name(int tp_rank, int tp_size) {
  return "optimizer-tp" + std::to_string(tp_rank) + "-of" + std::to_string(tp_size) + ".safetensors";
}

// Called by every rank of the job (`world`); `dp_coordinate` picks the ranks that write the
// optimizer state (those at 0).
template <class PlanT>
void save_checkpoint(const std::filesystem::path& exp_dir, const TensorParallel<PlanT>& tp,
                     llama::LlamaForCausalLM& model, const train::AdamW& optimizer, const train::TrainState& state,
                     const train::RunIdentity& identity, const comm::AxisGroup& world, int dp_coordinate) {
  const std::string name = train::checkpoint_name(state.global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  auto full = tp.full_parameters();  // a collective over TP: every rank takes part
  on_rank_zero(world, [&] {
    std::filesystem::remove_all(partial_dir);
    std::filesystem::create_directories(partial_dir);
  });
  if (dp_coordinate == 0) {
    auto optimizer_state = optimizer.state();
    for (auto& rng : train::capture_rng_states()) optimizer_state.push_back(std::move(rng));
    io::save_safetensors(partial_dir / tp_optimizer_name(tp.group().rank(), tp.group().size()), optimizer_state);
  }
  comm::barrier(world);  // every shard is on disk before rank 0 publishes the folder
  on_rank_zero(world, [&] {
    llama::save_pretrained(model->config, full, partial_dir);
    io::write_file_atomically(partial_dir / "state.json", train::to_json(state, identity).dump(2) + "\n");
    train::publish_checkpoint(exp_dir, name);
  });
}

template <class PlanT>
std::optional<train::TrainState> load_checkpoint(const std::filesystem::path& exp_dir, const TensorParallel<PlanT>& tp,
                                                 llama::LlamaForCausalLM& model, train::AdamW& optimizer,
                                                 const train::RunIdentity& identity, const comm::AxisGroup& world) {
  const auto found = checkpoint_to_resume(exp_dir, world);
  if (!found) return std::nullopt;
  const auto& resolved = *found;
  const train::TrainState state = train::read_train_state(resolved, identity);
  llama::load_pretrained_weights(model, resolved,
                                 [&](const std::string& name, const torch::Tensor& full) { return tp.shard_of(name, full); });
  const auto file = resolved / tp_optimizer_name(tp.group().rank(), tp.group().size());
  if (!std::filesystem::exists(file))
    throw ConfigError(file.string() + " is missing: optimizer state is saved per TP rank and resumes on the same "
                      "TP size (" + std::to_string(tp.group().size()) + " here); the weights alone load at any TP size "
                      "through -m " + resolved.string());
  auto contents = io::load_safetensors(file);
  optimizer.load_state(contents, file.string());
  train::restore_rng_states(contents, file);
  comm::barrier(world);
  return state;
}

}  // namespace meshtorch::parallel
