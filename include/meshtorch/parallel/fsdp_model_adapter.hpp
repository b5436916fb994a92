#pragma once
// What FullyShardedDataParallel (parallel/fsdp.hpp) asks of the model family whose tree it
// shards, and nothing else about it: how a weight starts, and which tensors of a full state dict
// are not weights. Sharding, gathering and reducing need no more than the tree's WeightModules;
// parallel/fsdp_llama.hpp gives Llama's.
//
// A struct of functions rather than a traits type FSDP is templated on: FSDP's body is compiled
// once (MESHTORCH_SEPARATE_COMPILATION), and a traits parameter would make it a template
// compiled again for every model family and every unit of a program that names one.
#include <functional>
#include <string>

#include <meshtorch/torch.hpp>

#include <meshtorch/models/weight_module.hpp>

namespace meshtorch {

struct FsdpModelAdapter {
  // Fills `full`, the whole of the leaf's tensor `tensor` (its weight or bias; on the compute
  // device, in the shards' dtype), as the family's own initialisation fills it. Called for every
  // tensor in leaf_tensors() order on every rank, so drawing from the default generator gives
  // each rank the same numbers and the sharded model the single-process one's.
  // Unset: FullyShardedDataParallel::init_weights() refuses.
  std::function<void(const LeafTensor& tensor, torch::Tensor& full)> initialise;
  // Whether a tensor of a full state dict that names no weight of the model may be passed over
  // (an HF folder's rotary tables, the lm_head of a model that ties it to the embedding).
  // Unset: none may.
  std::function<bool(const std::string& name)> not_a_weight;
};

}  // namespace meshtorch
