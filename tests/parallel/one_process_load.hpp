#pragma once
// The end of every layout's parity test: its pieces and AdamW state saved as a checkpoint, which,
// loaded into one process (a world of one, whole tensors: other boxes than any layout saved), must
// hold the one-process reference's weights and AdamW state.
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>

namespace meshtorch::testing {

// A checkpoint of a parallel model and its optimizer in a fresh folder of the temporary directory,
// named after `tag` and the master port (so runs beside each other do not meet); remove() deletes
// it once every rank is done with it.
class TemporaryCheckpoint {
 public:
  template <class Parallel>
  TemporaryCheckpoint(const std::string& tag, const comm::AxisGroup& world, int master_port, const Parallel& parallel,
                      train::AdamW& optimizer, std::int64_t step)
      : world_(world), dir_(std::filesystem::temp_directory_path() / fmt::format("meshtorch-{}-{}", tag, master_port)) {
    if (world_.rank() == 0) std::filesystem::remove_all(dir_);
    comm::barrier(world_);
    pieces = parallel.sharded_parameters();
    for (auto& piece : optimizer_state_pieces(optimizer, pieces)) pieces.push_back(std::move(piece));
    saved = save_training_checkpoint(dir_, pieces, {.global_step = step, .running_loss = 1.0}, {}, world_,
                                     {.layout = parallel.layout()});
  }

  void remove() {
    comm::barrier(world_);
    if (world_.rank() == 0) std::filesystem::remove_all(dir_);
  }

  std::vector<io::ShardedTensor> pieces;  // what was saved: the model's, then AdamW's
  checkpoint::SavedCheckpoint saved;

 private:
  comm::AxisGroup world_;
  std::filesystem::path dir_;
};

inline void check_loads_as_reference(const std::filesystem::path& folder, const llama::Config& config,
                                     llama::LlamaForCausalLM& reference, train::AdamW& reference_optimizer) {
  llama::LlamaForCausalLM restored(config, torch::TensorOptions().device(torch::kMeta));
  llama::materialize(restored, torch::TensorOptions());
  train::AdamW restored_optimizer(train::named_trainable_parameters(*restored), {.lr = 1e-3});
  std::vector<io::ShardedTensor> one_process;
  for (const auto& item : restored->named_parameters())
    one_process.push_back(io::replicated(item.key(), item.value(), /*writer=*/true));
  for (auto& piece : optimizer_state_pieces(restored_optimizer, one_process)) one_process.push_back(std::move(piece));
  checkpoint::load_sharded_checkpoint(folder, one_process);

  std::map<std::string, torch::Tensor> restored_state;
  for (const auto& [name, tensor] : restored_optimizer.state()) restored_state[name] = tensor;
  for (const auto& [name, tensor] : reference_optimizer.state()) {
    INFO(name);
    const auto difference = ((restored_state.at(name) - tensor).abs().max() / tensor.abs().max().clamp_min(1e-30));
    CHECK(difference.template item<double>() < 2e-3);
  }
  auto restored_weights = restored->named_parameters();
  for (const auto& item : reference->named_parameters()) {
    INFO(item.key());
    CHECK(
        ((restored_weights[item.key()] - item.value()).abs().max() / item.value().abs().max()).template item<double>() <
        2e-3);
  }
}

}  // namespace meshtorch::testing
