#pragma once
// The training state a checkpoint carries beside the tensors (state.json): epoch, global_step,
// epoch_step, the running loss, and the flags that fix the data order, which a resumed run must
// share. The tensors and the folder are parallel/checkpointing.hpp's business.
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

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

MESHTORCH_DECL TrainState read_train_state(const nlohmann::json& j, const std::string& state_path,
                                           const RunIdentity& identity) {
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
    if (saved != ours)
      throw ConfigError(
          fmt::format("{}: the checkpoint was written with {} = {}, this run has {}; resume with the "
                      "same flags or use a new -e/--experiment-name",
                      state_path, key, saved, ours));
  };
  same("seed", identity.seed);
  same("seq_length", identity.seq_length);
  same("global_batch", identity.global_batch);
  same("dataset", identity.dataset);
  same("model", identity.model);
  return state;
}

MESHTORCH_DECL TrainState read_train_state(const std::filesystem::path& dir, const RunIdentity& identity) {
  const auto path = dir / "state.json";
  return read_train_state(io::read_json_file(path), path.string(), identity);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
