#pragma once
// The training state a checkpoint carries beside the tensors (state.json): epoch, global_step,
// epoch_step, the running loss, and the flags that fix the data order, which a resumed run must
// share. The tensors and the folder are parallel/checkpointing.hpp's business.
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/state.hpp>

namespace meshtorch::train {

// The link in an experiment folder that names its latest complete checkpoint.
inline constexpr std::string_view checkpoint_link_name = "checkpoint";

// Flags a resumed run must share with the run that saved, or its data order would differ.
struct RunIdentity {
  std::uint64_t seed = 0;
  std::int64_t seq_length = 0;
  std::int64_t global_batch = 0;
  std::string dataset;
  std::string model;
};

// state.json's contents.
MESHTORCH_DECL nlohmann::ordered_json to_json(const TrainState& s, const RunIdentity& id);

// The training state of a checkpoint's state.json (`j`, read from `state_path`), refusing one
// whose data-order flags differ from this run's. Every field is checked for its type and range,
// so a damaged file names the field at fault.
MESHTORCH_DECL TrainState read_train_state(const nlohmann::json& j, const std::string& state_path,
                                           const RunIdentity& identity);

// The same from <dir>/state.json.
MESHTORCH_DECL TrainState read_train_state(const std::filesystem::path& dir, const RunIdentity& identity);

// state.json's run record (the flags that fix the data order), every field checked for its type:
// what read_train_state compares with this run's, and what meshtorch-eval-loss reads.
MESHTORCH_DECL RunIdentity read_run_identity(const nlohmann::json& j, const std::string& state_path);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/io/json_file.hpp>

namespace meshtorch::train {

MESHTORCH_DECL nlohmann::ordered_json to_json(const TrainState& s, const RunIdentity& id) {
  return {{"epoch", s.epoch},
          {"global_step", s.global_step},
          {"epoch_step", s.epoch_step},
          {"running_loss", s.running_loss},
          {"running_steps", s.running_steps},
          {"run",
           {{"seed", id.seed},
            {"seq_length", id.seq_length},
            {"global_batch", id.global_batch},
            {"dataset", id.dataset},
            {"model", id.model}}}};
}

namespace checkpoint_detail {

inline const nlohmann::json& field(const nlohmann::json& object, const std::string& key,
                                   const std::string& state_path) {
  if (!object.contains(key)) throw DataError(state_path + ": field '" + key + "' is missing");
  return object[key];
}

// A non-negative integer that fits int64 (nlohmann reads a non-negative integer as unsigned, a
// negative one as signed); `shown` names it in the message.
inline std::int64_t count(const nlohmann::json& object, const std::string& key, const std::string& shown,
                          const std::string& state_path) {
  const auto& value = field(object, key, state_path);
  const bool fits = value.is_number_unsigned() &&
                    value.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  if (!fits)
    throw DataError(state_path + ": field '" + shown + "' must be a non-negative integer, got " + value.dump());
  return value.get<std::int64_t>();
}

}  // namespace checkpoint_detail

MESHTORCH_DECL RunIdentity read_run_identity(const nlohmann::json& j, const std::string& state_path) {
  using checkpoint_detail::field;
  if (!j.is_object()) throw DataError(state_path + ": expected a JSON object at the top level");
  const auto& run = field(j, "run", state_path);
  if (!run.is_object()) throw DataError(state_path + ": field 'run' must be an object, got " + run.dump());
  const auto text = [&](const std::string& key) {
    const auto& value = field(run, key, state_path);
    if (!value.is_string())
      throw DataError(state_path + ": field 'run." + key + "' must be a string, got " + value.dump());
    return value.get<std::string>();
  };
  const auto& seed = field(run, "seed", state_path);
  if (!seed.is_number_unsigned())
    throw DataError(state_path + ": field 'run.seed' must be a non-negative integer, got " + seed.dump());
  RunIdentity identity;
  identity.seed = seed.get<std::uint64_t>();
  identity.seq_length = checkpoint_detail::count(run, "seq_length", "run.seq_length", state_path);
  identity.global_batch = checkpoint_detail::count(run, "global_batch", "run.global_batch", state_path);
  identity.dataset = text("dataset");
  identity.model = text("model");
  return identity;
}

MESHTORCH_DECL TrainState read_train_state(const nlohmann::json& j, const std::string& state_path,
                                           const RunIdentity& identity) {
  if (!j.is_object()) throw DataError(state_path + ": expected a JSON object at the top level");
  const auto count = [&](const std::string& key) { return checkpoint_detail::count(j, key, key, state_path); };
  TrainState state;
  state.epoch = count("epoch");
  state.global_step = count("global_step");
  state.epoch_step = count("epoch_step");
  const auto& running_loss = checkpoint_detail::field(j, "running_loss", state_path);
  if (!running_loss.is_number())
    throw DataError(state_path + ": field 'running_loss' must be a number, got " + running_loss.dump());
  state.running_loss = running_loss.get<double>();
  state.running_steps = count("running_steps");
  const auto saved = read_run_identity(j, state_path);
  const auto same = [&](const std::string& key, const auto& written, const auto& ours) {
    if (written != ours)
      throw ConfigError(
          fmt::format("{}: the checkpoint was written with {} = {}, this run has {}; resume with the "
                      "same flags or use a new -e/--experiment-name",
                      state_path, key, written, ours));
  };
  same("seed", saved.seed, identity.seed);
  same("seq_length", saved.seq_length, identity.seq_length);
  same("global_batch", saved.global_batch, identity.global_batch);
  same("dataset", saved.dataset, identity.dataset);
  same("model", saved.model, identity.model);
  return state;
}

MESHTORCH_DECL TrainState read_train_state(const std::filesystem::path& dir, const RunIdentity& identity) {
  const auto path = dir / "state.json";
  return read_train_state(io::read_json_file(path), path.string(), identity);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
