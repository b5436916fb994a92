#pragma once
// Checkpoint and resume, as the guide's chapter 1 does it, made crash-safe.
//
// <exp>/ckpt-<step>/ holds config.json + model.safetensors (an HF folder), optimizer.safetensors
// (AdamW state and RNG states) and state.json (epoch, global_step, epoch_step, running_loss and
// the flags that fix the data order). <exp>/checkpoint is a symlink to the newest complete one:
// a save writes a new folder, fsyncs it, then swaps the link with rename(2), so a crash at any
// point leaves the previous checkpoint loadable.
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "meshtorch/error.hpp"
#include "meshtorch/io/atomic_file.hpp"
#include "meshtorch/io/safetensors.hpp"
#include "meshtorch/models/llama/weights.hpp"
#include "meshtorch/train/adamw.hpp"
#include "meshtorch/train/rng.hpp"
#include "meshtorch/train/state.hpp"

namespace meshtorch::train {

// Flags a resumed run must share with the run that saved, or its data order would differ.
struct RunIdentity {
  std::uint64_t seed = 0;
  std::int64_t seq_length = 0;
  std::int64_t global_batch = 0;
  std::string dataset;
  std::string model;
};

inline nlohmann::ordered_json to_json(const TrainState& s, const RunIdentity& id) {
  return {{"epoch", s.epoch},
          {"global_step", s.global_step},
          {"epoch_step", s.epoch_step},
          {"running_loss", s.running_loss},
          {"running_steps", s.running_steps},
          {"run", {{"seed", id.seed},
                   {"seq_length", id.seq_length},
                   {"global_batch", id.global_batch},
                   {"dataset", id.dataset},
                   {"model", id.model}}}};
}

inline std::filesystem::path latest_checkpoint(const std::filesystem::path& exp_dir) {
  return exp_dir / "checkpoint";
}

inline std::string checkpoint_name(std::int64_t global_step) {
  char name[32];
  std::snprintf(name, sizeof name, "ckpt-%08lld", static_cast<long long>(global_step));
  return name;
}

// Moves a complete <exp>/<name>.partial to <exp>/<name>, points <exp>/checkpoint at it and
// removes older checkpoints. The folder's contents must already be fsynced.
inline void publish_checkpoint(const std::filesystem::path& exp_dir, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path final_dir = exp_dir / name;
  const fs::path partial_dir = exp_dir / (name + ".partial");
  io::fsync_path(partial_dir);
  fs::remove_all(final_dir);
  fs::rename(partial_dir, final_dir);
  io::fsync_path(exp_dir);

  const fs::path link = latest_checkpoint(exp_dir);
  const fs::path temporary_link = exp_dir / "checkpoint.tmp";
  fs::remove(temporary_link);
  fs::create_directory_symlink(name, temporary_link);
  fs::rename(temporary_link, link);
  io::fsync_path(exp_dir);

  // Older checkpoints are no longer referenced.
  for (const auto& entry : fs::directory_iterator(exp_dir)) {
    const auto file = entry.path().filename().string();
    if (file.rfind("ckpt-", 0) == 0 && file != name) fs::remove_all(entry.path());
  }
}

inline void save_checkpoint(const std::filesystem::path& exp_dir, llama::LlamaForCausalLM& model,
                            const AdamW& optimizer, const TrainState& state, const RunIdentity& identity) {
  const std::string name = checkpoint_name(state.global_step);
  const auto partial_dir = exp_dir / (name + ".partial");
  std::filesystem::remove_all(partial_dir);
  std::filesystem::create_directories(partial_dir);

  llama::save_pretrained(model, partial_dir);
  auto optimizer_state = optimizer.state();
  for (auto& rng : capture_rng_states()) optimizer_state.push_back(std::move(rng));
  io::save_safetensors(partial_dir / "optimizer.safetensors", optimizer_state);
  io::write_file_atomically(partial_dir / "state.json", to_json(state, identity).dump(2) + "\n");
  publish_checkpoint(exp_dir, name);
}

// Reads <dir>/state.json, refusing a checkpoint whose data-order flags differ from this run's.
// Every field is checked for its type and range, so a damaged file names the field at fault.
inline TrainState read_train_state(const std::filesystem::path& dir, const RunIdentity& identity) {
  const auto path = dir / "state.json";
  const auto state_path = path.string();
  const auto j = io::read_json_file(path);
  if (!j.is_object()) throw DataError(state_path + ": expected a JSON object at the top level");
  auto field = [&](const nlohmann::json& object, const std::string& key) -> const nlohmann::json& {
    if (!object.contains(key)) throw DataError(state_path + ": field '" + key + "' is missing");
    return object[key];
  };
  auto count = [&](const nlohmann::json& object, const std::string& key, const std::string& shown) {
    const auto& value = field(object, key);
    // nlohmann reads a non-negative integer as unsigned, a negative one as signed.
    const bool fits =
        value.is_number_unsigned() &&
        value.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    if (!fits)
      throw DataError(state_path + ": field '" + shown + "' must be a non-negative integer, got " + value.dump());
    return value.get<std::int64_t>();
  };
  TrainState state;
  state.epoch = count(j, "epoch", "epoch");
  state.global_step = count(j, "global_step", "global_step");
  state.epoch_step = count(j, "epoch_step", "epoch_step");
  const auto& running_loss = field(j, "running_loss");
  if (!running_loss.is_number())
    throw DataError(state_path + ": field 'running_loss' must be a number, got " + running_loss.dump());
  state.running_loss = running_loss.get<double>();
  state.running_steps = count(j, "running_steps", "running_steps");
  const auto& run = field(j, "run");
  if (!run.is_object()) throw DataError(state_path + ": field 'run' must be an object, got " + run.dump());
  auto same = [&](const std::string& key, const auto& ours) {
    using T = std::decay_t<decltype(ours)>;
    T saved{};
    if constexpr (std::is_same_v<T, std::string>) {
      const auto& value = field(run, key);
      if (!value.is_string())
        throw DataError(state_path + ": field 'run." + key + "' must be a string, got " + value.dump());
      saved = value.template get<std::string>();
    } else if constexpr (std::is_unsigned_v<T>) {
      const auto& value = field(run, key);
      if (!value.is_number_unsigned())
        throw DataError(state_path + ": field 'run." + key + "' must be a non-negative integer, got " + value.dump());
      saved = value.template get<T>();
    } else {
      saved = count(run, key, "run." + key);
    }
    if (saved != ours) {
      std::ostringstream message;
      message << state_path << ": the checkpoint was written with " << key << " = " << saved << ", this run has "
              << ours << "; resume with the same flags or use a new -e/--experiment-name";
      throw ConfigError(message.str());
    }
  };
  same("seed", identity.seed);
  same("seq_length", identity.seq_length);
  same("global_batch", identity.global_batch);
  same("dataset", identity.dataset);
  same("model", identity.model);
  return state;
}

// Restores model, optimizer and RNG from <exp>/checkpoint if it exists, and returns the state.
inline std::optional<TrainState> load_checkpoint(const std::filesystem::path& exp_dir, llama::LlamaForCausalLM& model,
                                                 AdamW& optimizer, const RunIdentity& identity) {
  const auto dir = latest_checkpoint(exp_dir);
  if (!std::filesystem::exists(dir / "state.json")) return std::nullopt;
  const TrainState state = read_train_state(dir, identity);
  llama::load_pretrained_weights(model, dir);
  const auto optimizer_file = dir / "optimizer.safetensors";
  auto contents = io::load_safetensors(optimizer_file);
  optimizer.load_state(contents, optimizer_file.string());
  restore_rng_states(contents, optimizer_file);
  return state;
}

}  // namespace meshtorch::train
