#pragma once
// How an Experiment (train/experiment.hpp) saves and resumes a model: one path for every layout.
// Each rank hands the sharded checkpoint (checkpoint/) its own pieces of the
// weights and of AdamW's state, as boxes of the global tensors, plus its RNG states; a load fills
// this rank's boxes from whatever pieces were saved, so a run resumes on another mesh or world
// size. No rank gathers a full weight to save; the format is docs/checkpoints.md's.
//
//   model                           pieces                             writer of identical copies
//   LlamaForCausalLM (chapter 1)    whole weights                      the one process
//   ParallelLlama<Mesh>             TP chunk, then FSDP rows           DP coordinate 0, TP rank 0
//   + ZeroRedundancyOptimizer       AdamW state of the owned weights   the owner
//
// Every rank calls save and load: both are collectives over the whole job.
#include <concepts>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/checkpoint/load.hpp>
#include <meshtorch/checkpoint/optimizer_state.hpp>
#include <meshtorch/checkpoint/save.hpp>
#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/parallel/parallelize.hpp>
#include <meshtorch/parallel/zero.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/checkpoint.hpp>
#include <meshtorch/train/experiment.hpp>
#include <meshtorch/train/optimizer.hpp>
#include <meshtorch/train/state.hpp>

namespace meshtorch {

// AdamW's state with the boxes of the weights it steps.
MESHTORCH_DECL std::vector<io::ShardedTensor> optimizer_state_pieces(const train::AdamW& optimizer,
                                                                     const std::vector<io::ShardedTensor>& weights);

// ZeRO-1's state: each rank holds (and writes) the state of the weights it owns, whole. A load on
// another world size fills each rank's new share from whichever rank saved it.
MESHTORCH_DECL std::vector<io::ShardedTensor> optimizer_state_pieces(const ZeroRedundancyOptimizer& optimizer,
                                                                     const std::vector<io::ShardedTensor>& weights);

// Either of the two, through the optimizer interface (chapter 2 picks one by a flag).
MESHTORCH_DECL std::vector<io::ShardedTensor> optimizer_state_pieces(const train::Optimizer& optimizer,
                                                                     const std::vector<io::ShardedTensor>& weights);

// Saves <exp_dir>/ckpt-<step> from every rank's pieces, with this rank's RNG states and
// state.json. A non-finite running loss is never saved: the previous checkpoint stays the latest.
MESHTORCH_DECL checkpoint::SavedCheckpoint save_training_checkpoint(
    const std::filesystem::path& exp_dir, const std::vector<io::ShardedTensor>& tensors, const train::TrainState& state,
    const train::RunIdentity& identity, const comm::AxisGroup& world, const checkpoint::SaveOptions& options);

// Fills every rank's pieces from the checkpoint <exp_dir>/checkpoint links to and returns its
// training state, or nothing for a fresh experiment. All ranks must find the same folder (one
// save directory they all see); when any rank cannot, every rank throws.
MESHTORCH_DECL std::optional<train::TrainState> load_training_checkpoint(const std::filesystem::path& exp_dir,
                                                                         std::vector<io::ShardedTensor>& tensors,
                                                                         const train::RunIdentity& identity,
                                                                         const comm::AxisGroup& world);

// config.json of the model as saved: consolidation turns the checkpoint into an HF folder with it.
MESHTORCH_DECL std::map<std::string, std::string> config_file(const llama::Config& config, torch::ScalarType dtype);

// Chapter 1's model holding every weight of `source` whole, for generation and evaluation in one
// process. `source` is an HF folder (config.json and safetensors weights), a sharded checkpoint
// saved on any mesh and world size (a ckpt-<step> folder: every file checked against its manifest
// first, the optimizer's state left unread), or an experiment folder (the checkpoint its link
// names). `dtype`: the weights' own when absent.
struct WholeModel {
  llama::LlamaForCausalLM model;
  std::filesystem::path folder;  // where config.json and the weights were read: the checkpoint's, for an experiment
  bool from_checkpoint = false;
};

MESHTORCH_DECL WholeModel load_whole_model(const std::filesystem::path& source,
                                           std::optional<torch::ScalarType> dtype = {});

}  // namespace meshtorch

namespace meshtorch::train {

// Chapter 1's model: one process saves every weight whole.
template <>
struct Checkpointing<llama::LlamaForCausalLM> {
  MESHTORCH_DECL static std::vector<io::ShardedTensor> weights(llama::LlamaForCausalLM& model);

  template <class Optimizer>
  static void save(const std::filesystem::path& exp_dir, llama::LlamaForCausalLM& model, const Optimizer& optimizer,
                   const TrainState& state, const RunIdentity& identity, int keep_checkpoints) {
    auto tensors = weights(model);
    for (auto& piece : meshtorch::optimizer_state_pieces(optimizer, tensors)) tensors.push_back(std::move(piece));
    meshtorch::save_training_checkpoint(
        exp_dir, tensors, state, identity, comm::single_process_group(),
        {.layout = "one process",
         .extra_files = meshtorch::config_file(model->config, model->parameters().front().scalar_type()),
         .keep = keep_checkpoints});
  }

  template <class Optimizer>
  static std::optional<TrainState> load(const std::filesystem::path& exp_dir, llama::LlamaForCausalLM& model,
                                        Optimizer& optimizer, const RunIdentity& identity) {
    auto tensors = weights(model);
    for (auto& piece : meshtorch::optimizer_state_pieces(optimizer, tensors)) tensors.push_back(std::move(piece));
    return meshtorch::load_training_checkpoint(exp_dir, tensors, identity, comm::single_process_group());
  }
};

// A model parallelize() built (ParallelLlama, PipelineLlama): its pieces as the mesh type cut them.
template <class Model>
concept ShardedLlamaModel = requires(Model& model) {
  { model.sharded_parameters() } -> std::same_as<std::vector<io::ShardedTensor>>;
  { model.world() } -> std::convertible_to<const comm::AxisGroup&>;
  { model.layout() } -> std::convertible_to<std::string>;
  { model.coordinate() } -> std::convertible_to<std::string>;
  { model.module()->config } -> std::convertible_to<llama::Config>;
};

template <class Model>
requires ShardedLlamaModel<Model>
struct Checkpointing<Model> {
  template <class Optimizer>
  static std::vector<io::ShardedTensor> pieces(const Model& model, const Optimizer& optimizer) {
    auto tensors = model.sharded_parameters();
    for (auto& piece : meshtorch::optimizer_state_pieces(optimizer, tensors)) tensors.push_back(std::move(piece));
    return tensors;
  }

  template <class Optimizer>
  static void save(const std::filesystem::path& exp_dir, Model& model, const Optimizer& optimizer,
                   const TrainState& state, const RunIdentity& identity, int keep_checkpoints) {
    const auto dtype = model.named_parameters().front().second.scalar_type();
    meshtorch::save_training_checkpoint(exp_dir, pieces(model, optimizer), state, identity, model.world(),
                                        {.layout = model.layout(),
                                         .extra_files = meshtorch::config_file(model.module()->config, dtype),
                                         .coordinate = model.coordinate(),
                                         .keep = keep_checkpoints});
  }

  template <class Optimizer>
  static std::optional<TrainState> load(const std::filesystem::path& exp_dir, Model& model, Optimizer& optimizer,
                                        const RunIdentity& identity) {
    auto tensors = pieces(model, optimizer);
    return meshtorch::load_training_checkpoint(exp_dir, tensors, identity, model.world());
  }
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <cmath>
#include <exception>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/rng.hpp>

namespace meshtorch {

MESHTORCH_DECL std::vector<io::ShardedTensor> optimizer_state_pieces(const train::AdamW& optimizer,
                                                                     const std::vector<io::ShardedTensor>& weights) {
  return checkpoint::adamw_state_tensors(optimizer, weights);
}

MESHTORCH_DECL std::vector<io::ShardedTensor> optimizer_state_pieces(const ZeroRedundancyOptimizer& optimizer,
                                                                     const std::vector<io::ShardedTensor>& weights) {
  std::set<std::string> owned;
  for (const auto& [name, parameter] : optimizer.owned_parameters()) owned.insert(name);
  std::vector<io::ShardedTensor> mine;
  for (const auto& weight : weights) {
    if (!owned.contains(weight.name)) continue;
    if (weight.box != io::whole(weight.global_shape))
      throw ConfigError(
          fmt::format("checkpoint: ZeroRedundancyOptimizer steps '{}', of which this rank holds only "
                      "{}; ZeRO-1 shards whole weights over a DP-only mesh (use AdamW with FSDP or TP)",
                      weight.name, io::to_string(weight.box)));
    auto piece = weight;
    piece.writer = true;  // the owner is the one rank of its DP group holding this state
    mine.push_back(std::move(piece));
  }
  return checkpoint::adamw_state_tensors(optimizer, mine);
}

MESHTORCH_DECL std::vector<io::ShardedTensor> optimizer_state_pieces(const train::Optimizer& optimizer,
                                                                     const std::vector<io::ShardedTensor>& weights) {
  if (const auto* zero = dynamic_cast<const ZeroRedundancyOptimizer*>(&optimizer))
    return optimizer_state_pieces(*zero, weights);
  return checkpoint::adamw_state_tensors(optimizer, weights);
}

MESHTORCH_DECL checkpoint::SavedCheckpoint save_training_checkpoint(
    const std::filesystem::path& exp_dir, const std::vector<io::ShardedTensor>& tensors, const train::TrainState& state,
    const train::RunIdentity& identity, const comm::AxisGroup& world, const checkpoint::SaveOptions& options) {
  if (!std::isfinite(state.running_loss))
    throw DataError(
        fmt::format("not saving the checkpoint of global_step {} into {}: the running loss is {}; the "
                    "previous checkpoint stays the latest",
                    state.global_step, exp_dir.string(), state.running_loss));
  return checkpoint::save_sharded_checkpoint(exp_dir, state.global_step, tensors, train::to_json(state, identity),
                                             train::capture_rng_states(), world, options);
}

MESHTORCH_DECL std::optional<train::TrainState> load_training_checkpoint(const std::filesystem::path& exp_dir,
                                                                         std::vector<io::ShardedTensor>& tensors,
                                                                         const train::RunIdentity& identity,
                                                                         const comm::AxisGroup& world) {
  const train::Logger log(world.global_rank());
  checkpoint::ResumePoint point;
  std::exception_ptr failure;
  try {
    point = checkpoint::find_checkpoint_to_resume(exp_dir);
  } catch (...) {
    failure = std::current_exception();
  }
  const auto failed = checkpoint::detail::failed_ranks(world, failure != nullptr);
  if (failure) std::rethrow_exception(failure);
  if (!failed.empty())
    throw DataError(fmt::format("rank(s) {} could not tell which checkpoint of {} to resume from (see their logs)",
                                fmt::join(failed, ", "), exp_dir.string()));
  const auto found = point.checkpoint ? point.checkpoint->string() : std::string("no checkpoint");
  const auto seen = comm::all_gather_object(world, found);
  for (int r = 0; r < world.size(); ++r)
    if (seen[static_cast<std::size_t>(r)] != seen[0])
      throw ConfigError(
          fmt::format("rank {} resumes from '{}' but rank {} from '{}': --save-dir must be one folder "
                      "that every rank sees (a shared file system)",
                      world.global_rank_of(r), seen[static_cast<std::size_t>(r)], world.global_rank_of(0), seen[0]));
  if (world.rank() == 0)
    for (const auto& partial : point.ignored_partial)
      log.warning(fmt::format("ignoring {}: a save that did not finish", partial.string()));
  if (!point.checkpoint) return std::nullopt;

  const auto& dir = *point.checkpoint;
  const auto loaded = checkpoint::load_sharded_checkpoint(dir, tensors, world);
  auto state = train::read_train_state(loaded.state, (dir / checkpoint::state_file_name).string(), identity);
  if (loaded.rank_state)
    train::restore_rng_states(io::SafetensorsFile{*loaded.rank_state, {}},
                              dir / checkpoint::rank_file_name(world.rank()));
  else if (world.rank() == 0)
    log.warning(loaded.rank_state_note);
  if (world.rank() == 0 && loaded.manifest.world_size != world.size())
    log.info(fmt::format("resharded {} from {} ranks ({}) onto {}", dir.string(), loaded.manifest.world_size,
                         loaded.manifest.layout, world.size()));
  return state;
}

MESHTORCH_DECL std::map<std::string, std::string> config_file(const llama::Config& config, torch::ScalarType dtype) {
  return {{"config.json", llama::config_to_json(config, llama::dtype_name(dtype)).dump(2) + "\n"}};
}

MESHTORCH_DECL WholeModel load_whole_model(const std::filesystem::path& source,
                                           std::optional<torch::ScalarType> dtype) {
  if (!std::filesystem::is_directory(source))
    throw ConfigError(fmt::format("{}: not a folder (a model folder, a ckpt-<step> checkpoint or an experiment folder)",
                                  source.string()));
  const bool model_folder = llama::has_pretrained_weights(source);
  const auto point = model_folder ? checkpoint::ResumePoint{} : checkpoint::find_checkpoint_to_resume(source);
  if (!model_folder && !point.checkpoint)
    throw ConfigError(fmt::format(
        "{}: no weights here: neither model.safetensors (or its index) of a model folder, nor {} of a checkpoint, "
        "nor an experiment folder's '{}' link to one",
        source.string(), checkpoint::manifest_file_name, checkpoint::checkpoint_link_name));
  const auto folder = model_folder ? source : *point.checkpoint;
  const auto config = llama::resolve_model(folder.string());
  if (model_folder) {
    const auto type = dtype.value_or(llama::pretrained_dtype(folder).value_or(torch::kFloat));
    WholeModel whole{llama::LlamaForCausalLM(config, torch::TensorOptions().dtype(type)), folder, false};
    llama::load_pretrained_weights(whole.model, folder);
    return whole;
  }
  // Loaded in the dtype it was saved in (a load never converts silently), then cast if asked.
  const auto manifest = checkpoint::read_manifest(folder);
  const auto* embedding = manifest.find("model.embed_tokens.weight");
  if (!embedding)
    throw DataError(fmt::format("{}: holds no model.embed_tokens.weight: not a checkpoint of a Llama-style model",
                                folder.string()));
  WholeModel whole{llama::LlamaForCausalLM(config, torch::TensorOptions().dtype(embedding->dtype)), folder, true};
  auto tensors = train::Checkpointing<llama::LlamaForCausalLM>::weights(whole.model);
  {
    torch::NoGradGuard no_grad;
    checkpoint::load_sharded_checkpoint(folder, tensors);
  }
  if (dtype && *dtype != embedding->dtype) whole.model->to(*dtype);
  return whole;
}

}  // namespace meshtorch

namespace meshtorch::train {

MESHTORCH_DECL std::vector<io::ShardedTensor> Checkpointing<llama::LlamaForCausalLM>::weights(
    llama::LlamaForCausalLM& model) {
  std::vector<io::ShardedTensor> pieces;
  for (const auto& item : model->named_parameters())
    pieces.push_back(io::replicated(item.key(), item.value(), /*writer=*/true));
  return pieces;
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
