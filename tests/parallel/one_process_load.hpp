#pragma once
// A sharded checkpoint loaded into one process (a world of one, whole tensors: other boxes than any
// layout saved) must hold the one-process reference's weights and AdamW state: the check every
// layout's parity test ends with.
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>

namespace meshtorch::testing {

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
