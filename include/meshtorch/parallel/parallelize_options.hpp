#pragma once
// What parallelize (parallel/parallelize.hpp) is asked to build, and how the chapters' flags say
// it: the device, -m's weights and who reads them, activation checkpointing, the loss chunk, and
// each wrapper's options.
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/layout/pipeline_action.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/ddp.hpp>
#include <meshtorch/parallel/fsdp_options.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch {

// Who reads a model folder's weights (ParallelizeOptions::weights_read_by).
enum class WeightsReadBy {
  // Each rank reads, of every weight, only the rows its piece lies in: no traffic, every rank
  // must see the folder (node-local copies or a shared file system).
  every_rank,
  // The guide's way: rank 0 reads each weight whole and broadcasts it over the world; every rank
  // keeps its piece. Only rank 0 needs the files.
  rank0,
  // Local rank 0 of each node reads each weight whole and broadcasts it over its node: for
  // node-local copies of the folder (the guide's advice to keep $HF_HOME on each node's disk).
  local_rank0,
};

// The --weights-read-by spelling of each choice.
inline constexpr std::array<std::pair<WeightsReadBy, std::string_view>, 3> weights_read_by_names{
    {{WeightsReadBy::every_rank, "every-rank"},
     {WeightsReadBy::rank0, "rank0"},
     {WeightsReadBy::local_rank0, "local-rank0"}}};

inline std::string_view to_string(WeightsReadBy read_by) {
  for (const auto& [value, name] : weights_read_by_names)
    if (value == read_by) return name;
  return "?";
}

inline WeightsReadBy parse_weights_read_by(const std::string& text) {
  for (const auto& [value, name] : weights_read_by_names)
    if (text == name) return value;
  throw ConfigError(fmt::format("--weights-read-by '{}': use every-rank, rank0 or local-rank0", text));
}

// For the PP axis: the schedule and the stages (docs/pipeline.md).
struct PipelineOptions {
  pp::ScheduleKind schedule = pp::ScheduleKind::one_f_one_b;
  int stages_per_rank = 1;
  // Micro-batches each rank's batch is split into for the schedule; 0: as many as stages.
  int microbatches = 0;
  // Units (the embedding, each decoder layer, the norm and head) per stage, in stage order; empty:
  // the split that makes the slowest stage fastest by the cost model (llama::stage_unit_costs).
  std::vector<int> units_per_stage;
  // The sequence length the cost model weighs attention at (0: 1024).
  std::int64_t seq_length = 0;
};

struct ParallelizeOptions {
  // Where forward and backward compute (the shards live there too unless fsdp.cpu_offload).
  torch::Device device = torch::kCPU;
  // An HF model folder whose weights fill this rank's pieces; empty: initialise them as
  // chapter 1 does (HF's _init_weights from the current seed).
  std::filesystem::path weights_from;
  WeightsReadBy weights_read_by = WeightsReadBy::every_rank;
  // How errors name the model (the -m value): a config the TP plan cannot split is refused
  // before anything is built.
  std::string model_name = "model config";
  // Decoder layers recomputed in backward (after tensor parallel, before FSDP, as torchtitan).
  ActivationCheckpointing activation_checkpointing;
  // Positions whose logits the loss computes at once (models/chunked_loss.hpp): -1 automatic.
  std::int64_t loss_chunk = -1;
  // The fused kernels of kernels/ (--fused on), or the composite ops.
  bool fused_kernels = true;
  // For the FSDP axis (device is taken from above).
  FsdpOptions fsdp;
  // For the DP axis.
  DdpOptions ddp;
  // (ZeRO-2 over DP instead of DDP is not an option here but parallelize's last argument,
  // ZeroStage2Options, which the mesh type allows or refuses at compile time.)
  // For the PP axis.
  PipelineOptions pipeline;
  // For the CP axis: how keys and values reach every rank (--cp-rotate).
  cp::Rotate cp_rotate = cp::Rotate::ring;
};

// The folder to read weights from when -m names a model folder that holds weights; empty for a
// preset or a folder with only a config.json.
inline std::filesystem::path pretrained_weights_folder(const std::string& model_name_or_dir) {
  if (std::filesystem::is_directory(model_name_or_dir) && llama::has_pretrained_weights(model_name_or_dir))
    return model_name_or_dir;
  return {};
}

// The options every chapter takes from its flags: the device, -m's weights (and who reads them),
// activation checkpointing, the loss chunk, the fused kernels. A chapter adds its own (fsdp, ddp) to the result.
inline ParallelizeOptions parallelize_options(const train::TrainArgs& args, torch::Device device) {
  ParallelizeOptions options;
  options.device = device;
  options.weights_from = pretrained_weights_folder(args.model_name);
  options.weights_read_by = parse_weights_read_by(args.weights_read_by);
  options.model_name = args.model_name;
  options.activation_checkpointing = activation_checkpointing(args);
  options.loss_chunk = args.loss_chunk;
  options.fused_kernels = args.fused == "on";
  return options;
}

// fully_shard's options from the FSDP chapters' flags: shards and optimizer in fp32 (the dtype
// the model is built in), compute in `compute_dtype`, gradients reduced in fp32.
inline FsdpOptions fsdp_options(const train::FsdpArgs& args, torch::ScalarType compute_dtype) {
  return {.reshard_after_forward = args.reshard_after_forward,
          .cpu_offload = args.cpu_offload,
          .mixed_precision = {.param_dtype = compute_dtype, .reduce_dtype = torch::kFloat},
          .prefetch_layers = args.prefetch_layers};
}

// The pipeline's options from chapter 11's flags; `seq_length` weighs attention in the cost model.
inline PipelineOptions pipeline_options(const train::PipelineArgs& args, std::int64_t seq_length) {
  return {.schedule = *pp::parse_schedule_flag(args.schedule),  // the flag's check allows only known names
          .stages_per_rank = args.stages_per_rank,
          .microbatches = args.microbatches,
          .units_per_stage = args.units_per_stage,
          .seq_length = seq_length};
}

}  // namespace meshtorch
