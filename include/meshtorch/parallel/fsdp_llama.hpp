#pragma once
// Llama as one user of FullyShardedDataParallel (parallel/fsdp.hpp): what FSDP needs to know of
// the family (its FsdpModelAdapter) and loading an HF folder into the shards. Sharding itself
// is the caller's: a unit per decoder layer, then the root.
//
//   FullyShardedDataParallel fsdp(model, group, options, llama_fsdp_adapter(model->config));
//   for (auto& layer : model->model->decoder_layers) fsdp.fully_shard(layer);
//   fsdp.fully_shard(model);
//   if (!load_pretrained_weights_if_present(fsdp, dir)) fsdp.init_weights();
#include <filesystem>

#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/fsdp_model_adapter.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// Initialises each weight as llama::init_weights does (llama::init_weight), and passes over
// what an HF folder holds beside the weights: rotary tables, and lm_head when it is tied to the
// embedding.
MESHTORCH_DECL FsdpModelAdapter llama_fsdp_adapter(const llama::Config& config);

// Loads an HF folder's model.safetensors (or the shards its index lists) into the shards: each
// rank reads every weight whole and keeps its rows.
MESHTORCH_DECL void load_pretrained_weights(FullyShardedDataParallel& fsdp, const std::filesystem::path& dir);
// The same when `model_name_or_dir` is a folder with weights; false (nothing loaded) otherwise.
MESHTORCH_DECL bool load_pretrained_weights_if_present(FullyShardedDataParallel& fsdp,
                                                       const std::filesystem::path& model_name_or_dir);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <string>

#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/models/llama/weights.hpp>

namespace meshtorch {

MESHTORCH_DECL FsdpModelAdapter llama_fsdp_adapter(const llama::Config& config) {
  return {
      .initialise = [config](const LeafTensor& tensor,
                             torch::Tensor& full) { llama::init_weight(*tensor.leaf, tensor.slot, full, config); },
      .not_a_weight =
          [tied = config.tie_word_embeddings](const std::string& name) {
            return name.find("rotary_emb.inv_freq") != std::string::npos || (tied && name == "lm_head.weight");
          },
  };
}

MESHTORCH_DECL void load_pretrained_weights(FullyShardedDataParallel& fsdp, const std::filesystem::path& dir) {
  io::NamedTensors all;
  for (const auto& reader : llama::open_weight_files(dir))
    for (const auto& entry : reader.header().entries) all.emplace_back(entry.name, reader.read(entry));
  fsdp.load_full_state_dict(all, dir.string());
}

MESHTORCH_DECL bool load_pretrained_weights_if_present(FullyShardedDataParallel& fsdp,
                                                       const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_directory(model_name_or_dir) || !llama::has_pretrained_weights(model_name_or_dir))
    return false;
  load_pretrained_weights(fsdp, model_name_or_dir);
  return true;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
