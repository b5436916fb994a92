#pragma once
// Llama weights in HF's safetensors layout: one model.safetensors, or shards listed in
// model.safetensors.index.json. Names are HF's (the module tree mirrors LlamaForCausalLM), so a
// folder saved here loads in transformers' from_pretrained and the other way round.
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "meshtorch/io/safetensors.hpp"
#include "meshtorch/models/llama/config_json.hpp"
#include "meshtorch/models/llama/model.hpp"

namespace meshtorch::llama {

inline std::string dtype_name(torch::ScalarType type) {
  return type == torch::kBFloat16 ? "bfloat16" : type == torch::kHalf ? "float16" : "float32";
}

// Writes config.json and model.safetensors (the given full tensors, HF-named) into `dir`, each
// file atomically. Sharded models gather their tensors first and call this.
inline void save_pretrained(const Config& config, const io::NamedTensors& tensors, const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const auto dtype = tensors.empty() ? torch::kFloat : tensors.front().second.scalar_type();
  io::write_file_atomically(dir / "config.json", config_to_json(config, dtype_name(dtype)).dump(2) + "\n");
  io::save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
}

inline void save_pretrained(LlamaForCausalLM& lm, const std::filesystem::path& dir) {
  io::NamedTensors tensors;
  for (const auto& item : lm->named_parameters()) tensors.emplace_back(item.key(), item.value());
  save_pretrained(lm->config, tensors, dir);
}

// Maps a full tensor from a checkpoint to the part of it this rank holds (a sharded model's
// piece); the identity for a whole model.
using ShardOf = std::function<torch::Tensor(const std::string& name, const torch::Tensor& full)>;

inline bool has_pretrained_weights(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "model.safetensors") ||
         std::filesystem::exists(dir / "model.safetensors.index.json");
}

// The safetensors files of an HF folder: model.safetensors, or the shards that
// model.safetensors.index.json lists.
inline std::vector<std::filesystem::path> weight_files(const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / "model.safetensors")) return {dir / "model.safetensors"};
  const auto index_path = dir / "model.safetensors.index.json";
  std::ifstream in(index_path);
  if (!in) throw DataError(dir.string() + ": no model.safetensors or model.safetensors.index.json");
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(index_path.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object())
    throw DataError(index_path.string() + ": field 'weight_map' is missing");
  std::set<std::string> shards;
  for (const auto& [name, shard] : index["weight_map"].items()) shards.insert(shard.get<std::string>());
  std::vector<std::filesystem::path> files;
  for (const auto& shard : shards) files.push_back(dir / shard);
  return files;
}

// Copies HF weights from `dir` into the model's (already materialised) parameters, converting
// dtype and device. Every parameter must be found with its shape; extra tensors are an error
// except the rotary inv_freq buffers some exports carry.
inline void load_pretrained_weights(LlamaForCausalLM& lm, const std::filesystem::path& dir,
                                    const ShardOf& shard_of = {}) {
  const auto files = weight_files(dir);
  auto params = lm->named_parameters();
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (const auto& file : files) {
    auto contents = io::load_safetensors(file);
    for (auto& [name, tensor] : contents.tensors) {
      auto* target = params.find(name);
      if (!target) {
        if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
        if (name == "lm_head.weight" && lm->config.tie_word_embeddings) continue;
        throw DataError(file.string() + ": tensor '" + name + "' is not a parameter of this Llama config");
      }
      const auto piece = shard_of ? shard_of(name, tensor) : tensor;
      if (piece.sizes() != target->sizes())
        throw DataError(file.string() + ": tensor '" + name + "' has shape " + c10::str(tensor.sizes()) +
                        (shard_of ? ", whose piece here has shape " + c10::str(piece.sizes()) : std::string()) +
                        ", config.json implies " + c10::str(target->sizes()));
      target->copy_(piece);
      loaded.insert(name);
    }
  }
  for (const auto& item : params)
    if (!loaded.count(item.key()))
      throw DataError(dir.string() + ": weights lack parameter '" + item.key() + "'");
}

// The dtype a folder's config.json gives its weights ("dtype", or "torch_dtype" before
// transformers 5), or nothing for a preset or a file that does not say. transformers 5 loads a
// model in this dtype unless told otherwise; `--dtype auto` does the same with it.
inline std::optional<torch::ScalarType> pretrained_dtype(const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_regular_file(model_name_or_dir / "config.json")) return std::nullopt;
  const auto name = load_config_file(model_name_or_dir / "config.json").dtype;
  if (!name) return std::nullopt;
  return *name == "bfloat16" ? torch::kBFloat16 : *name == "float16" ? torch::kHalf : torch::kFloat;
}

// `-m` names a preset or a folder: a folder's weights, if it holds any, replace the
// initialisation. Returns whether weights were loaded.
inline bool load_pretrained_weights_if_present(LlamaForCausalLM& lm, const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_directory(model_name_or_dir) || !has_pretrained_weights(model_name_or_dir)) return false;
  load_pretrained_weights(lm, model_name_or_dir);
  return true;
}

}  // namespace meshtorch::llama
