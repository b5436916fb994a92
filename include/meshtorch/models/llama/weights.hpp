#pragma once
// Llama weights in HF's safetensors layout: one model.safetensors, or shards listed in
// model.safetensors.index.json. Names are HF's (the module tree mirrors LlamaForCausalLM), so a
// folder saved here loads in transformers' from_pretrained and the other way round.
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/io/model_folder.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/safetensors_writer.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

inline std::string dtype_name(torch::ScalarType type) {
  return type == torch::kBFloat16 ? "bfloat16" : type == torch::kHalf ? "float16" : "float32";
}

// Writes config.json and model.safetensors (the given full tensors, HF-named) into `dir`, each
// file atomically. Sharded models gather their tensors first and call this.
MESHTORCH_DECL void save_pretrained(const Config& config, const io::NamedTensors& tensors,
                                    const std::filesystem::path& dir);

inline void save_pretrained(LlamaForCausalLM& lm, const std::filesystem::path& dir) {
  io::NamedTensors tensors;
  for (const auto& item : lm->named_parameters()) tensors.emplace_back(item.key(), item.value());
  save_pretrained(lm->config, tensors, dir);
}

// Maps a full tensor from a checkpoint to the part of it this rank holds (a sharded model's
// piece); the identity for a whole model.
using ShardOf = std::function<torch::Tensor(const std::string& name, const torch::Tensor& full)>;

inline bool has_pretrained_weights(const std::filesystem::path& dir) {
  return io::present_in_folder(dir / "model.safetensors") ||
         io::present_in_folder(dir / "model.safetensors.index.json");
}

// The safetensors files of an HF folder, opened and their headers checked once: model.safetensors,
// or the shards that model.safetensors.index.json lists. The index is checked against the shards'
// headers: each shard holds exactly the tensors weight_map places in it, so reading every file
// reads each tensor once, from the shard the map names.
MESHTORCH_DECL std::vector<io::SafetensorsReader> open_weight_files(const std::filesystem::path& dir);

// Refuses a weight stored in an integer or bool dtype (`where` names the file or state dict):
// every Llama weight is floating point, and converting one would train on its integer values.
MESHTORCH_DECL void check_weight_dtype(const std::string& where, const std::string& name, torch::ScalarType dtype);

// Copies HF weights from `dir` into the model's (already materialised) parameters, converting
// dtype and device. Every parameter must be found with its shape; extra tensors are an error
// except the rotary inv_freq buffers some exports carry.
MESHTORCH_DECL void load_pretrained_weights(LlamaForCausalLM& lm, const std::filesystem::path& dir,
                                            const ShardOf& shard_of = {});

// The dtype a folder's config.json gives its weights ("dtype", or "torch_dtype" before
// transformers 5), or nothing for a preset or a file that does not say. transformers 5 loads a
// model in this dtype unless told otherwise; `--dtype auto` does the same with it.
MESHTORCH_DECL std::optional<torch::ScalarType> pretrained_dtype(const std::filesystem::path& model_name_or_dir);

// The dtype `--dtype auto` trains a folder's pretrained weights in: its config.json's, when the
// folder holds weights (a config-only folder is a model from scratch: the device's default).
inline std::optional<torch::ScalarType> weights_dtype(const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_directory(model_name_or_dir) || !has_pretrained_weights(model_name_or_dir))
    return std::nullopt;
  return pretrained_dtype(model_name_or_dir);
}

// `-m` names a preset or a folder: a folder's weights, if it holds any, replace the
// initialisation. Returns whether weights were loaded.
inline bool load_pretrained_weights_if_present(LlamaForCausalLM& lm, const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_directory(model_name_or_dir) || !has_pretrained_weights(model_name_or_dir)) return false;
  load_pretrained_weights(lm, model_name_or_dir);
  return true;
}

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/json_file.hpp>

namespace meshtorch::llama {

MESHTORCH_DECL void save_pretrained(const Config& config, const io::NamedTensors& tensors,
                                    const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const auto dtype = tensors.empty() ? torch::kFloat : tensors.front().second.scalar_type();
  io::write_file_atomically(dir / "config.json", config_to_json(config, dtype_name(dtype)).dump(2) + "\n");
  io::save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
}

MESHTORCH_DECL std::vector<io::SafetensorsReader> open_weight_files(const std::filesystem::path& dir) {
  std::vector<io::SafetensorsReader> readers;
  if (io::present_in_folder(dir / "model.safetensors")) {
    readers.emplace_back(io::model_file(dir, "model.safetensors", dir.string() + ": the weights file"));
    return readers;
  }
  if (!io::present_in_folder(dir / "model.safetensors.index.json"))
    throw DataError(fmt::format("{}: no model.safetensors or model.safetensors.index.json", dir.string()));
  const auto index_path = io::model_file(dir, "model.safetensors.index.json", dir.string() + ": the index file");
  const std::string index_name = index_path.string();
  // A tensor listed twice in weight_map is refused (nlohmann alone would keep the last).
  auto index = io::read_json_file(index_path);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw DataError(
        fmt::format("{}: field 'weight_map' (an object of tensor name -> shard file) is missing", index_name));
  if (index["weight_map"].empty()) throw DataError(fmt::format("{}: weight_map lists no tensors", index_name));

  std::map<std::string, std::string> shard_of_tensor;
  std::map<std::string, std::set<std::string>> tensors_of_shard;
  for (const auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string())
      throw DataError(
          fmt::format("{}: weight_map['{}'] must be a shard's file name, got {}", index_name, tensor, shard.dump()));
    shard_of_tensor[tensor] = shard.get<std::string>();
    tensors_of_shard[shard.get<std::string>()].insert(tensor);
  }
  for (const auto& [shard, tensors] : tensors_of_shard) {
    const auto file = io::model_file(dir, shard, index_name + ": weight_map['" + *tensors.begin() + "']");
    const auto& header = readers.emplace_back(file).header();
    for (const auto& entry : header.entries) {
      const auto it = shard_of_tensor.find(entry.name);
      if (it == shard_of_tensor.end())
        throw DataError(fmt::format("{}: holds tensor '{}', which the weight_map of {} does not list", file.string(),
                                    entry.name, index_name));
      if (it->second != shard)
        throw DataError(fmt::format("{}: holds tensor '{}', which the weight_map of {} places in '{}'", file.string(),
                                    entry.name, index_name, it->second));
    }
    for (const auto& tensor : tensors)
      if (!header.contains(tensor))
        throw DataError(fmt::format("{}: weight_map places tensor '{}' in '{}', which does not hold it", index_name,
                                    tensor, shard));
  }
  return readers;
}

MESHTORCH_DECL void check_weight_dtype(const std::string& where, const std::string& name, torch::ScalarType dtype) {
  if (!c10::isFloatingType(dtype))
    throw DataError(
        fmt::format("{}: tensor '{}' is stored as {}, not a floating-point dtype; the model's weights are "
                    "floating point (F32, F16, BF16 or F64) and converting it would train on its integer "
                    "values",
                    where, name, c10::toString(dtype)));
}

MESHTORCH_DECL void load_pretrained_weights(LlamaForCausalLM& lm, const std::filesystem::path& dir,
                                            const ShardOf& shard_of) {
  const auto readers = open_weight_files(dir);
  auto params = lm->named_parameters();
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (const auto& reader : readers) {
    const auto file = reader.path();
    for (const auto& entry : reader.header().entries) {
      const auto& name = entry.name;
      auto* target = params.find(name);
      if (!target) {
        if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
        if (name == "lm_head.weight" && lm->config.tie_word_embeddings) continue;
        throw DataError(fmt::format("{}: tensor '{}' is not a parameter of this Llama config", file.string(), name));
      }
      check_weight_dtype(file.string(), name, entry.dtype);
      const auto tensor = reader.read(entry);
      const auto piece = shard_of ? shard_of(name, tensor) : tensor;
      if (piece.sizes() != target->sizes())
        throw DataError(fmt::format(
            "{}: tensor '{}' has shape {}{}, config.json implies {}", file.string(), name, c10::str(tensor.sizes()),
            shard_of ? fmt::format(", whose piece here has shape {}", c10::str(piece.sizes())) : std::string(),
            c10::str(target->sizes())));
      target->copy_(piece);
      loaded.insert(name);
    }
  }
  for (const auto& item : params)
    if (!loaded.count(item.key()))
      throw DataError(fmt::format("{}: weights lack parameter '{}'", dir.string(), item.key()));
}

MESHTORCH_DECL std::optional<torch::ScalarType> pretrained_dtype(const std::filesystem::path& model_name_or_dir) {
  if (!std::filesystem::is_regular_file(model_name_or_dir / "config.json")) return std::nullopt;
  const auto name = load_config_file(model_name_or_dir / "config.json").dtype;
  if (!name) return std::nullopt;
  return *name == "bfloat16" ? torch::kBFloat16 : *name == "float16" ? torch::kHalf : torch::kFloat;
}

}  // namespace meshtorch::llama
#endif  // MESHTORCH_DEFINES(core)
