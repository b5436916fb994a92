#pragma once
// PipelineLlama<M>: what parallelize() builds for a mesh with a PP axis. The model is cut into
// stages (pp::StageSplit: the embedding, the decoder layers and the norm with the head as units,
// split by the cost model or a list), this rank keeps only the weights of the stages the schedule
// places on it, and step() runs the schedule's table (parallel/pipeline_runtime.hpp) over the
// micro-batches of this rank's batch. Then, before the optimizer:
//   - a tied embedding, held by the first stage (to embed) and the last (as the head), gets the
//     sum of both gradients on both copies, so the two copies stay equal;
//   - over DP, the replicas' gradients are averaged (one coalesced all-reduce after the schedule).
// The loss of each micro-batch is its token losses' sum divided by the step's token count on
// this rank, so the step's gradients and loss are those of chapter 1's mean over the same batch.
//
// Weights are drawn in chapter 1's order with its random numbers (a stage draws and drops the
// weights it does not keep) or read from -m's folder, only those this rank keeps.
//
// Axes: PP, with TP inside every stage (the plan's styles, as chapter 6), CP splitting every
// micro-batch's sequence inside the stages (parallel/context_parallel.hpp: each rank of a stage
// runs its head-tail chunks), FSDP sharding every stage's weights over FSDP x CP (a unit per
// decoder layer, and the embedding, the final norm and the head each a unit of its own, gathered
// and reduce-scattered micro-batch by micro-batch), and DP for replicas, whose gradients (and,
// without FSDP, the CP ranks') are averaged after the schedule.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/layout/pipeline_split.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/models/llama/plan.hpp>
#include <meshtorch/parallel/context_parallel.hpp>
#include <meshtorch/parallel/data_parallel_groups.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/parallelize_options.hpp>
#include <meshtorch/parallel/pipeline_runtime.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>
#include <meshtorch/parallel/weight_piece.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// The groups of a mesh with a PP axis that PipelineLlama uses.
struct PipelineGroups {
  comm::AxisGroup world;
  comm::AxisGroup pp;
  std::optional<comm::AxisGroup> tp;  // absent without a TP axis
  std::optional<comm::AxisGroup> cp;  // absent without a CP axis
  // FSDP's (inside each stage), the replicas' (averaged after the schedule), the sampler's and the
  // loss's groups.
  DataParallelGroups data;
  // With TP: the plan's styles as values, its config check, and whether it cuts the sequence
  // between layers (sequence parallel), which sets the shape stages pass.
  const tp_detail::PlanSteps* tp_steps = nullptr;
  void (*validate_tp)(const llama::Config& config, std::int64_t tp_size, std::string_view source) = nullptr;
  bool sequence_parallel = false;
  std::string_view mesh_name;
  std::string coordinate;  // "rank 3 of 4 on cpu: DP 1 of 2, PP 1 of 2"
};

class PipelineLlamaRuntime {
 public:
  MESHTORCH_DECL PipelineLlamaRuntime(llama::LlamaForCausalLM model, PipelineGroups groups,
                                      const ParallelizeOptions& options);
  PipelineLlamaRuntime(PipelineLlamaRuntime&&) noexcept = default;
  PipelineLlamaRuntime& operator=(PipelineLlamaRuntime&&) noexcept = default;

  // Forward and backward of this rank's batch [B, S] under the schedule, B split into the
  // schedule's micro-batches; afterwards this rank's gradients are final (tied copies summed, DP
  // replicas averaged). Returns the batch's mean loss on every rank of the PP group.
  MESHTORCH_DECL torch::Tensor step(const torch::Tensor& input_ids, const torch::Tensor& labels);

  // The weights this rank trains (its stages'), HF-named.
  MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;
  // Every weight this rank trains as a whole box of the global weight, for checkpoints; of
  // identical copies (DP replicas, the last stage's tied embedding) one rank writes.
  MESHTORCH_DECL std::vector<io::ShardedTensor> sharded_parameters() const;
  // Clipping by the norm of the whole model's gradient, over every stage and replica counted once.
  MESHTORCH_DECL double clip_grad_norm(double max_norm) const;

  int data_parallel_rank() const { return data_parallel_ ? data_parallel_->rank() : 0; }
  int data_parallel_size() const { return data_parallel_ ? data_parallel_->size() : 1; }
  const std::optional<comm::AxisGroup>& data_parallel() const { return data_parallel_; }
  // The mean over DP, FSDP and CP of a value every rank of a PP group holds the same (step()'s
  // loss, of which each CP rank holds its chunks' share x CP).
  MESHTORCH_DECL torch::Tensor mean_over_data_parallel(torch::Tensor value) const;
  // Any sequence length splits over pipeline stages; context parallel cuts it into 2 x CP chunks,
  // sequence parallel every rank's positions over TP.
  MESHTORCH_DECL void validate_sequence(std::int64_t seq_length) const;

  // "Mesh<DP=2, PP=2>: pipeline 1F1B over PP (4 stages: ...) -> DDP over DP", recorded in checkpoints.
  MESHTORCH_DECL std::string layout() const;
  const std::string& coordinate() const { return coordinate_; }
  // "<layout()>; this rank holds stages 1, 3 (...): 123 of the model's 456 parameters, float32".
  MESHTORCH_DECL std::string summary() const;
  // What the schedule's steps measured, gathered over the PP group (every rank of it must call):
  // each stage's compute time per step, the slowest over the mean, and each rank's idle share
  // beside the table's bubble. "" before a step after the first.
  MESHTORCH_DECL std::string stage_balance() const;
  // The schedule's grid (pp::format_grid), for a chapter's log.
  std::string schedule_grid() const { return pp::format_grid(runner_->table()); }

  const pp::StageSplit& split() const { return split_; }
  const std::vector<int>& local_stages() const { return local_stages_; }
  MESHTORCH_DECL std::int64_t local_numel() const;
  llama::LlamaForCausalLM& module() { return model_; }
  const llama::LlamaForCausalLM& module() const { return model_; }
  const comm::AxisGroup& world() const { return world_; }
  const comm::AxisGroup& pipeline_group() const { return pp_; }
  FullyShardedDataParallel* fully_sharded() const { return fsdp_.get(); }

 private:
  // Which unit (0 embedding, 1..L layers, L+1 norm and head) an HF weight name belongs to.
  MESHTORCH_DECL int unit_of(const std::string& name) const;
  MESHTORCH_DECL bool holds_unit(int unit) const;
  // Whether the stage computes with the unit's weights: its own units, and on the head's stage a
  // tied embedding (the one place that rule is written).
  MESHTORCH_DECL bool uses_unit(const pp::StageLayers& part, int unit) const;
  // Whether this rank keeps the weight: its stages' units, and the tied embedding on the head's stage.
  MESHTORCH_DECL bool keeps(const std::string& name) const;
  // The copy another rank writes and counts: the tied embedding on the last stage's rank when the
  // first stage is elsewhere.
  MESHTORCH_DECL bool is_tied_copy(const std::string& name) const;
  // Where this rank's piece of a weight lies in the whole: its TP chunk, or all of it.
  MESHTORCH_DECL io::Box piece_box(const std::string& name) const;
  // Whether this rank writes (and counts in the gradient norm) its piece of the weight: one of
  // identical copies (DP replicas, TP ranks of a weight TP leaves whole, a tied copy).
  MESHTORCH_DECL bool writes(const std::string& name) const;
  // FSDP inside the stages: a unit per decoder layer this rank holds, and the embedding, the
  // final norm and the head each a unit, in the order the stages run.
  MESHTORCH_DECL void shard_stages(const comm::AxisGroup& group);
  // The table's UNSHARD and RESHARD of a stage: its units gathered and held for the step, then let go.
  MESHTORCH_DECL void gather_stage(int stage);
  MESHTORCH_DECL void release_stage(int stage);
  // After ZBV's input step (I) of `stage`: frees the layers it gathered, unless the stage is held.
  MESHTORCH_DECL void free_stage_until_weight_step(int stage);
  MESHTORCH_DECL void initialise();
  MESHTORCH_DECL void load_weights(const std::filesystem::path& dir);
  MESHTORCH_DECL torch::Tensor stage_forward(int stage, const torch::Tensor& input, int microbatch);
  // The weights `stage` computes with (the inputs of its weight-gradient step).
  MESHTORCH_DECL std::vector<torch::Tensor> stage_weights(int stage) const;
  // Whether this rank holds one of a tied embedding's two copies (first and last stage apart).
  MESHTORCH_DECL bool tied_gradient_exchanged() const;
  MESHTORCH_DECL torch::Tensor tied_weight() const;
  // Adds the other copy's gradient of this step to this one's (`before`: the gradient before it).
  MESHTORCH_DECL void sum_tied_gradients(const torch::Tensor& before);

  llama::LlamaForCausalLM model_;
  ParallelizeOptions options_;
  comm::AxisGroup world_, pp_;
  std::optional<comm::AxisGroup> replicas_, data_parallel_, loss_mean_;
  std::string_view mesh_name_;
  std::string coordinate_;
  int replica_ = 0;
  pp::StageSplit split_;
  std::vector<int> local_stages_;
  std::vector<std::pair<std::string, torch::Tensor>> trained_;      // HF name, weight; model order
  std::map<std::string, std::vector<std::int64_t>> global_shapes_;  // HF name -> whole shape
  std::unique_ptr<TensorParallelRuntime> tp_;
  std::unique_ptr<ContextParallel> cp_;
  std::unique_ptr<FullyShardedDataParallel> fsdp_;
  std::map<int, std::vector<FsdpUnit*>> stage_units_;  // FSDP's units of each of this rank's stages
  bool sequence_parallel_ = false;
  std::unique_ptr<PipelineRunner> runner_;
  // Of the step under way: each micro-batch's next-token targets, the step's token count, positions.
  std::vector<torch::Tensor> targets_;
  torch::Tensor step_tokens_, positions_;
};

// The pipeline model of a mesh type with a PP axis (parallelize() returns it for such meshes).
template <MeshType M>
class PipelineLlama : public PipelineLlamaRuntime {
  static_assert(llama::check_pipeline_parallelizable<M>());
  static constexpr bool has_tp = M::template has<TP>;
  static constexpr bool has_dp = M::template has<DP>;
  static constexpr bool has_fsdp = M::template has<FSDP>;
  static constexpr bool has_cp = M::template has<CP>;

 public:
  using mesh_type = M;
  using plan = llama::Plan<M>;

  PipelineLlama(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh, const ParallelizeOptions& options)
      : PipelineLlamaRuntime(std::move(model), groups_of(mesh), options) {}

  static std::string describe() {
    std::string out = "pipeline stages over PP";
    if constexpr (has_tp) out += " -> tensor parallel over TP (" + plan::describe_styles() + ") in each stage";
    if constexpr (M::template has<CP>) out += " -> context parallel over CP in each stage";
    if constexpr (has_fsdp)
      out += has_cp ? " -> FSDP over FSDP x CP in each stage" : " -> FSDP over FSDP in each stage";
    if constexpr (has_dp && has_cp && !has_fsdp)
      out += " -> DDP over DP x CP";
    else if constexpr (has_dp || (has_cp && !has_fsdp))
      out += has_dp ? " -> DDP over DP" : " -> DDP over CP";
    return out;
  }

 private:
  static constexpr const tp_detail::PlanSteps& tp_steps = tp_detail::plan_steps_if_tp<plan>;

  static PipelineGroups groups_of(const comm::DeviceMesh<M>& mesh) {
    PipelineGroups groups{
        .world = mesh.world(), .pp = mesh.template group<PP>(), .mesh_name = M::name, .coordinate = mesh.describe()};
    if constexpr (has_cp) groups.cp = mesh.template group<CP>();
    groups.data = data_parallel_groups(mesh);
    if constexpr (has_tp) {
      groups.tp = mesh.template group<TP>();
      groups.tp_steps = &tp_steps;
      groups.validate_tp = &plan::validate;
      groups.sequence_parallel = plan::sequence_parallel;
    }
    return groups;
  }
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <filesystem>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <meshtorch/error.hpp>
#include <meshtorch/models/llama/stage_costs.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/models/weight_module.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/fsdp_llama.hpp>
#include <meshtorch/train/grad_clipping.hpp>

namespace meshtorch {

MESHTORCH_DECL PipelineLlamaRuntime::PipelineLlamaRuntime(llama::LlamaForCausalLM model, PipelineGroups groups,
                                                          const ParallelizeOptions& options)
    : model_(std::move(model)),
      options_(options),
      world_(std::move(groups.world)),
      pp_(std::move(groups.pp)),
      replicas_(std::move(groups.data.replicas)),
      data_parallel_(std::move(groups.data.data_parallel)),
      loss_mean_(std::move(groups.data.loss_mean)),
      mesh_name_(groups.mesh_name),
      coordinate_(std::move(groups.coordinate)),
      replica_(groups.data.replica),
      sequence_parallel_(groups.tp && groups.sequence_parallel) {
  const auto& config = model_->config;
  const PipelineOptions& pipeline = options_.pipeline;
  const int stages = pp_.size() * pipeline.stages_per_rank;
  const int microbatches = pipeline.microbatches > 0 ? pipeline.microbatches : stages;
  // The schedule first: its rules name the flags, and it decides where each stage lives.
  // FSDP inside the stages without resharding after forward gathers each stage once a step: the
  // table's UNSHARD and RESHARD around the stage's actions (docs/pipeline.md).
  // FSDP of one rank (FSDP and CP both 1 at run time) would gather and reduce nothing: the stages
  // keep their weights whole, as without the axis.
  if (groups.data.fsdp && groups.data.fsdp->size() == 1) groups.data.fsdp.reset();
  const bool stage_gathers = groups.data.fsdp && !options_.fsdp.reshard_after_forward;
  // ZBV's weight step under FSDP is one backward from the stage's output (SplitBackward's
  // repeat_input_path). A checkpointed layer computes its weights' gradients when its backward
  // runs, in the input step; with an uncheckpointed layer before it in its stage the weight step
  // reaches it again and would count them twice.
  if (groups.data.fsdp && pipeline.schedule == pp::ScheduleKind::zero_bubble_v &&
      options_.activation_checkpointing.every > 1)
    throw ConfigError(fmt::format(
        "--activation-checkpointing {} with --schedule zbv and FSDP inside the stages: ZBV's weight step would "
        "run the backward of a checkpointed layer again and count its gradients twice; use "
        "--activation-checkpointing full or none, or another --schedule",
        options_.activation_checkpointing.every));
  pp::ScheduleTable table =
      pp::make_schedule(pipeline.schedule, pp_.size(), pipeline.stages_per_rank, microbatches, stage_gathers);
  const int layers = static_cast<int>(config.num_hidden_layers);
  if (!pipeline.units_per_stage.empty()) {
    if (static_cast<int>(pipeline.units_per_stage.size()) != stages)
      throw ConfigError(fmt::format("--units-per-stage lists {} stages, but --pp {} x --stages-per-rank {} makes {}",
                                    pipeline.units_per_stage.size(), pp_.size(), pipeline.stages_per_rank, stages));
    split_ = pp::StageSplit(layers, pipeline.units_per_stage);
  } else {
    const std::int64_t seq_length = pipeline.seq_length > 0 ? pipeline.seq_length : 1024;
    split_ = pp::StageSplit(layers, pp::balanced_units(llama::stage_unit_costs(config, seq_length), stages));
  }
  for (int s = 0; s < stages; ++s)
    if (table.shape.rank_of_stage(s) == pp_.rank()) local_stages_.push_back(s);

  for (const auto& tensor : leaf_tensors(*model_)) global_shapes_[tensor.name] = tensor.tensor().sizes().vec();
  // Tensor parallel inside every stage: each weight becomes its TP chunk (still on meta).
  if (groups.tp) {
    groups.validate_tp(config, groups.tp->size(), options_.model_name);
    tp_ = std::make_unique<TensorParallelRuntime>(model_, *groups.tp, *groups.tp_steps);
  }
  // Context parallel inside every stage: each layer's attention over the CP group's chunks.
  if (groups.cp) cp_ = std::make_unique<ContextParallel>(model_, *groups.cp, options_.cp_rotate);
  model_->loss_chunk = options_.loss_chunk;
  model_->use_fused_kernels(options_.fused_kernels);
  // Inside each chosen layer's hooks, so FSDP's gather is not redone.
  checkpoint_activations(model_, options_.activation_checkpointing);
  // This rank's weights only (FSDP: its rows of them); the others stay on the meta device.
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& tensor : leaf_tensors(*model_)) by_name[tensor.name] = tensor.tensor();
  if (groups.data.fsdp) {
    shard_stages(*groups.data.fsdp);
    trained_ = fsdp_->named_parameters();
  } else {
    for (const auto& tensor : leaf_tensors(*model_)) {
      if (!keeps(tensor.name)) continue;
      // A leaf's weight and bias are one stage's: materialised together, at the weight.
      if (tensor.slot == LeafSlot::weight)
        tensor.leaf->materialize(
            torch::TensorOptions().device(options_.device).dtype(tensor.leaf->weight.scalar_type()));
      trained_.emplace_back(tensor.name, tensor.tensor());
    }
  }
  for (const auto& [name, weight] : trained_) by_name[name] = weight;
  if (tp_) tp_->sum_norm_gradients_into(by_name);  // the norms of other stages never get a gradient
  if (options_.weights_from.empty())
    initialise();
  else
    load_weights(options_.weights_from);

  auto dtype = trained_.empty() ? torch::kFloat : trained_.front().second.scalar_type();
  if (fsdp_) dtype = options_.fsdp.mixed_precision.param_dtype.value_or(dtype);  // what the stages compute in
  runner_ = std::make_unique<PipelineRunner>(
      std::move(table), pp_,
      PipelineStages{.forward = [this](int stage, const torch::Tensor& input,
                                       int microbatch) { return stage_forward(stage, input, microbatch); },
                     .parameters = [this](int stage) { return stage_weights(stage); },
                     .activation_options = torch::TensorOptions().device(options_.device).dtype(dtype),
                     .weight_step_repeats_input_path = fsdp_ != nullptr,
                     .after_input_step = [this](int stage) { free_stage_until_weight_step(stage); },
                     .unshard = [this](int stage) { gather_stage(stage); },
                     .reshard = [this](int stage) { release_stage(stage); }});
}

MESHTORCH_DECL void PipelineLlamaRuntime::gather_stage(int stage) {
  for (FsdpUnit* unit : stage_units_.at(stage)) {
    unit->hold();
    unit->start_unshard();  // on the wire while the action before the stage's first computes
  }
}

MESHTORCH_DECL void PipelineLlamaRuntime::release_stage(int stage) {
  for (FsdpUnit* unit : stage_units_.at(stage)) unit->release();
}

MESHTORCH_DECL void PipelineLlamaRuntime::free_stage_until_weight_step(int stage) {
  if (!fsdp_) return;
  // The input step gathered every layer on its way (their gather nodes, which free them, run in the
  // weight step): a layer at a time means freeing them now, to gather again in the weight step.
  for (FsdpUnit* unit : stage_units_.at(stage))
    if (!unit->held() && unit->reshards_after_forward()) unit->reshard();
}

MESHTORCH_DECL void PipelineLlamaRuntime::shard_stages(const comm::AxisGroup& group) {
  options_.fsdp.device = options_.device;
  // Gathering whole stages (the table's UNSHARD, one compute action ahead) is their prefetch; the
  // units' own would gather the next stage's first layer before its UNSHARD, once more a step.
  if (!options_.fsdp.reshard_after_forward) options_.fsdp.prefetch_layers = 0;
  fsdp_ = std::make_unique<FullyShardedDataParallel>(model_, group, options_.fsdp, llama_fsdp_adapter(model_->config),
                                                     [this](const std::string& name) { return keeps(name); });
  auto& decoder = *model_->model;
  // Whether this rank's head stage projects with the embedding (tied).
  const bool projects = std::ranges::any_of(local_stages_, [&](int s) {
    const pp::StageLayers part = split_.stage(s);
    return part.head && uses_unit(part, 0);
  });
  // The embedding and the head stay gathered from a micro-batch's forward to its backward (the
  // head's weight is read outside lm_head's forward, a chunk of the loss at a time); a tied
  // embedding is one unit gathered by each use this rank makes of it.
  const auto shard_embedding = [&](bool embeds) {
    std::vector<ForwardHooks*> uses;
    if (embeds) uses.push_back(&decoder.embed_tokens->hooks);
    if (projects) uses.push_back(&model_->head_hooks);
    // Embedding's backward needs only the ids; projecting's needs the weights.
    return &fsdp_->fully_shard_used_by("model.embed_tokens", {decoder.embed_tokens.get()}, uses,
                                       /*backward_reads_weights=*/projects);
  };
  FsdpUnit* embedding = nullptr;
  for (const int stage : local_stages_) {
    const pp::StageLayers part = split_.stage(stage);
    auto& units = stage_units_[stage];
    if (stage != local_stages_.front()) fsdp_->start_prefetch_group();  // no prefetching across stages
    if (part.embedding) units.push_back(embedding = shard_embedding(true));
    for (int layer = part.first_layer; layer < part.end_layer; ++layer)
      units.push_back(&fsdp_->fully_shard(decoder.decoder_layers[static_cast<std::size_t>(layer)]));
    if (!part.head) continue;
    units.push_back(&fsdp_->fully_shard(decoder.norm));
    if (model_->lm_head)  // absent when tied to the embedding
      units.push_back(&fsdp_->fully_shard_used_by("lm_head", {model_->lm_head.get()}, {&model_->head_hooks}));
    else
      units.push_back(embedding ? embedding : (embedding = shard_embedding(false)));  // the head's use of it
  }
}

MESHTORCH_DECL int PipelineLlamaRuntime::unit_of(const std::string& name) const {
  static const std::string layers_prefix = "model.layers.";
  if (name == "model.embed_tokens.weight") return 0;
  if (name == "model.norm.weight" || name == "lm_head.weight") return split_.layers() + 1;
  if (name.rfind(layers_prefix, 0) == 0) return std::stoi(name.substr(layers_prefix.size())) + 1;
  throw ConfigError(fmt::format("pipeline: the weight {} belongs to no stage unit", name));
}

MESHTORCH_DECL bool PipelineLlamaRuntime::holds_unit(int unit) const {
  for (int s : local_stages_) {
    const pp::StageLayers part = split_.stage(s);
    if ((unit == 0 && part.embedding) || (unit == split_.layers() + 1 && part.head) ||
        (unit >= 1 && unit <= split_.layers() && unit - 1 >= part.first_layer && unit - 1 < part.end_layer))
      return true;
  }
  return false;
}

MESHTORCH_DECL bool PipelineLlamaRuntime::uses_unit(const pp::StageLayers& part, int unit) const {
  const bool layer = unit >= 1 && unit <= split_.layers() && unit - 1 >= part.first_layer && unit - 1 < part.end_layer;
  // The head's stage projects with a tied embedding: it holds its own copy.
  const bool embedding = unit == 0 && (part.embedding || (part.head && model_->config.tie_word_embeddings));
  return layer || embedding || (unit == split_.layers() + 1 && part.head);
}

MESHTORCH_DECL bool PipelineLlamaRuntime::keeps(const std::string& name) const {
  const int unit = unit_of(name);
  return std::ranges::any_of(local_stages_, [&](int s) { return uses_unit(split_.stage(s), unit); });
}

MESHTORCH_DECL bool PipelineLlamaRuntime::is_tied_copy(const std::string& name) const {
  return unit_of(name) == 0 && model_->config.tie_word_embeddings && !holds_unit(0);
}

MESHTORCH_DECL io::Box PipelineLlamaRuntime::piece_box(const std::string& name) const {
  return tp_fsdp_piece(name, global_shapes_.at(name), tp_.get(), fsdp_.get());
}

MESHTORCH_DECL bool PipelineLlamaRuntime::writes(const std::string& name) const {
  if (replica_ != 0 || is_tied_copy(name)) return false;
  return !tp_ || tp_->shard_dim(name) || tp_->group().rank() == 0;
}

MESHTORCH_DECL void PipelineLlamaRuntime::validate_sequence(std::int64_t seq_length) const {
  if (cp_) return cp_->validate_sequence(seq_length, sequence_parallel_ ? tp_->group().size() : 1);
  if (sequence_parallel_ && seq_length % tp_->group().size() != 0)
    throw ConfigError(fmt::format("-s {}: sequence parallel cuts every sequence over TP {}; use a multiple of {}",
                                  seq_length, tp_->group().size(), tp_->group().size()));
}

MESHTORCH_DECL void PipelineLlamaRuntime::initialise() {
  torch::NoGradGuard no_grad;
  // Every weight drawn whole in chapter 1's order, so that the random numbers match; this rank
  // keeps its piece of its stages' weights and drops the rest.
  const std::map<std::string, torch::Tensor> trained(trained_.begin(), trained_.end());
  for (const auto& tensor : leaf_tensors(*model_)) {
    const auto& name = tensor.name;
    const auto& shape = global_shapes_.at(name);
    auto full = torch::empty(shape, torch::TensorOptions().device(options_.device).dtype(tensor.tensor().dtype()));
    llama::init_weight(*tensor.leaf, tensor.slot, full, model_->config);
    if (const auto kept = trained.find(name); kept != trained.end())
      kept->second.copy_(io::view_of(full, io::whole(shape), piece_box(name)));
  }
}

MESHTORCH_DECL void PipelineLlamaRuntime::load_weights(const std::filesystem::path& dir) {
  torch::NoGradGuard no_grad;
  const auto readers = llama::open_weight_files(dir);
  for (auto& [name, weight] : trained_) {
    const io::SafetensorsEntry* entry = nullptr;
    const io::SafetensorsReader* reader = nullptr;
    for (const auto& candidate : readers)
      if (const auto* found = candidate.find(name)) {
        entry = found;
        reader = &candidate;
      }
    if (!entry) throw ConfigError(fmt::format("{}: the model folder has no weight {}", dir.string(), name));
    const auto& shape = global_shapes_.at(name);
    if (entry->shape != shape)
      throw ConfigError(fmt::format("{}: {} has shape [{}], the config gives [{}]", reader->path().string(), name,
                                    fmt::join(entry->shape, ", "), fmt::join(shape, ", ")));
    llama::check_weight_dtype(reader->path().string(), name, entry->dtype);
    weight.copy_(io::view_of(reader->read(*entry), io::whole(shape), piece_box(name)));
  }
}

MESHTORCH_DECL std::vector<torch::Tensor> PipelineLlamaRuntime::stage_weights(int stage) const {
  const pp::StageLayers part = split_.stage(stage);
  std::vector<torch::Tensor> weights;
  for (const auto& [name, weight] : trained_)
    if (uses_unit(part, unit_of(name))) weights.push_back(weight);
  return weights;
}

MESHTORCH_DECL torch::Tensor PipelineLlamaRuntime::stage_forward(int stage, const torch::Tensor& input,
                                                                 int microbatch) {
  const pp::StageLayers part = split_.stage(stage);
  auto& decoder = *model_->model;
  torch::Tensor hidden = part.embedding ? decoder.embed_tokens(input) : input;
  hidden = decoder.run_layers(hidden, positions_, part.first_layer, part.end_layer);
  if (!part.head) return hidden;
  return model_->head_loss_sum(decoder.norm(hidden), targets_.at(static_cast<std::size_t>(microbatch))) / step_tokens_;
}

MESHTORCH_DECL std::string PipelineLlamaRuntime::stage_balance() const {
  const auto& times = runner_->times();
  const int stages = runner_->stages(), ranks = pp_.size();
  // Each stage's compute, then each rank's step time, summed over the group: every stage and rank
  // is filled by the one rank that measured it.
  auto measured = torch::zeros({stages + ranks}, torch::kDouble);
  for (int s = 0; s < stages && static_cast<std::size_t>(s) < times.stage_compute.size(); ++s)
    measured[s] = times.stage_compute[static_cast<std::size_t>(s)];
  measured[stages + pp_.rank()] = times.steps;
  const torch::Device on(pp_.device_name());
  auto steps = torch::full({1}, static_cast<double>(times.step_count), torch::kDouble);
  measured = comm::all_reduce(pp_, measured.to(on), comm::ReduceOp::sum).cpu();
  steps = comm::all_reduce(pp_, steps.to(on), comm::ReduceOp::min).cpu();
  const double count = steps.item<double>();
  if (count < 1) return "";
  std::vector<double> per_stage(static_cast<std::size_t>(stages));
  for (int s = 0; s < stages; ++s) per_stage[static_cast<std::size_t>(s)] = measured[s].item<double>() / count;
  const double mean = std::accumulate(per_stage.begin(), per_stage.end(), 0.0) / stages;
  std::string stage_list, idle_list;
  for (int s = 0; s < stages; ++s)
    stage_list += fmt::format("{}{} {:.1f} ms", s ? ", " : "", s, per_stage[static_cast<std::size_t>(s)] * 1e3);
  for (int r = 0; r < ranks; ++r) {
    double busy = 0;
    for (int s = 0; s < stages; ++s)
      if (runner_->table().shape.rank_of_stage(s) == r) busy += per_stage[static_cast<std::size_t>(s)];
    const double step = measured[stages + r].item<double>() / count;
    idle_list += fmt::format("{}{} {:.0f}%", r ? ", " : "", r, step > 0 ? 100 * (1 - busy / step) : 0.0);
  }
  return fmt::format(
      "pipeline, {:.0f} steps after the first: compute per step by stage: {} (slowest / mean {:.2f}); idle per "
      "rank: {} (the table's bubble: {:.0f}%)",
      count, stage_list, *std::max_element(per_stage.begin(), per_stage.end()) / mean, idle_list,
      100 * pp::bubble_fraction(runner_->table()));
}

MESHTORCH_DECL torch::Tensor PipelineLlamaRuntime::step(const torch::Tensor& input_ids, const torch::Tensor& labels) {
  const int microbatches = runner_->microbatches();
  if (input_ids.dim() != 2 || input_ids.size(0) % microbatches != 0)
    throw ConfigError(
        fmt::format("pipeline: a batch of {} rows does not split into --microbatches {} equal "
                    "micro-batches; make -b a multiple of {}",
                    input_ids.dim() == 2 ? input_ids.size(0) : 0, microbatches, microbatches));
  // What a tied embedding's gradient held before this step (gradient accumulation): the two copies
  // exchange only what this step adds.
  const torch::Tensor tied_before =
      tied_gradient_exchanged() && tied_weight().grad().defined() ? tied_weight().grad().clone() : torch::Tensor();
  // A step that failed half way left its stages held (UNSHARD without RESHARD): start from none.
  for (auto& [stage, units] : stage_units_)
    for (FsdpUnit* unit : units)
      while (unit->held()) unit->release();
  // Under context parallel this rank runs its chunks of every sequence (at their positions, against
  // their targets), and its loss is CP x its tokens' share of the step's (parallel/context_parallel.hpp).
  const auto held = [this](const torch::Tensor& whole) { return cp_ ? cp_->held(whole) : whole; };
  const auto id_parts = held(input_ids).chunk(microbatches, 0);
  const auto label_parts = labels.chunk(microbatches, 0);
  targets_.clear();
  for (const auto& part : label_parts)
    targets_.push_back(held(llama::LlamaForCausalLMImpl::next_token_targets(part)).reshape({-1}));
  step_tokens_ = llama::LlamaForCausalLMImpl::next_token_targets(labels).ne(-100).sum().to(torch::kFloat);
  if (cp_) step_tokens_ = cp_->loss_divisor(step_tokens_);
  positions_ = cp_ ? cp_->held_positions(input_ids.size(1), input_ids.device())
                   : llama::LlamaModelImpl::default_positions(input_ids.size(1), input_ids.device());

  // Sequence parallel passes each rank's slice of its positions from stage to stage.
  const std::int64_t held_positions = positions_.size(1);
  const std::int64_t passed_positions = sequence_parallel_ ? held_positions / tp_->group().size() : held_positions;
  if (tp_) tp_->begin_backward_in_pieces();
  torch::Tensor loss = runner_->run(std::vector<torch::Tensor>(id_parts.begin(), id_parts.end()),
                                    {input_ids.size(0) / microbatches, passed_positions, model_->config.hidden_size});
  if (fsdp_) fsdp_->finish_gradients();  // every reduce-scatter landed before the sums below
  if (tp_) tp_->end_backward_in_pieces();
  targets_.clear();

  if (tied_gradient_exchanged()) sum_tied_gradients(tied_before);
  if (replicas_ && replicas_->size() > 1) {
    std::vector<torch::Tensor> grads;
    for (const auto& [name, weight] : trained_)
      if (weight.grad().defined()) grads.push_back(weight.grad());
    comm::all_reduce_coalesced(*replicas_, grads);
    torch::NoGradGuard no_grad;
    for (auto& grad : grads) grad.div_(static_cast<double>(replicas_->size()));
  }
  // The loss lives on the last stage's rank: summed over the PP group, zeros elsewhere.
  if (!loss.defined()) loss = torch::zeros({}, torch::TensorOptions().device(options_.device).dtype(torch::kFloat));
  return comm::all_reduce(pp_, loss.reshape({1})).reshape({});
}

MESHTORCH_DECL bool PipelineLlamaRuntime::tied_gradient_exchanged() const {
  if (!model_->config.tie_word_embeddings) return false;
  const auto& shape = runner_->table().shape;
  const int first = shape.rank_of_stage(0), last = shape.rank_of_stage(shape.stages() - 1);
  return first != last && (pp_.rank() == first || pp_.rank() == last);
}

MESHTORCH_DECL torch::Tensor PipelineLlamaRuntime::tied_weight() const {
  for (const auto& [name, tensor] : trained_)
    if (unit_of(name) == 0) return tensor;
  throw std::logic_error("pipeline: no embedding on a rank that exchanges its gradient");
}

MESHTORCH_DECL void PipelineLlamaRuntime::sum_tied_gradients(const torch::Tensor& before) {
  const auto& shape = runner_->table().shape;
  const int first = shape.rank_of_stage(0), last = shape.rank_of_stage(shape.stages() - 1);
  torch::Tensor weight = tied_weight();
  torch::NoGradGuard no_grad;
  torch::Tensor added = weight.grad().defined() ? weight.grad() : torch::zeros_like(weight);
  if (before.defined()) added = added - before;
  added = added.contiguous();
  const int peer = pp_.rank() == first ? last : first;
  auto theirs = torch::empty_like(added);
  const int tag = 2 * shape.stages() * shape.microbatches;  // past the schedule's tags
  auto receive = comm::receive_async(pp_, theirs, peer, tag);
  auto send = comm::send_async(pp_, added, peer, tag);
  receive.wait();
  send.wait();
  // Both sides add the first stage's part to the last's, in that order, so the copies stay equal.
  torch::Tensor sum = pp_.rank() == first ? added + theirs : theirs + added;
  if (before.defined()) sum = before + sum;
  if (weight.grad().defined())
    weight.mutable_grad().copy_(sum);
  else
    weight.mutable_grad() = sum;
}

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> PipelineLlamaRuntime::named_parameters() const {
  return trained_;
}

MESHTORCH_DECL std::vector<io::ShardedTensor> PipelineLlamaRuntime::sharded_parameters() const {
  std::vector<io::ShardedTensor> pieces;
  for (const auto& [name, weight] : trained_)
    pieces.push_back(io::sharded(name, weight, global_shapes_.at(name), piece_box(name), writes(name)));
  return pieces;
}

MESHTORCH_DECL double PipelineLlamaRuntime::clip_grad_norm(double max_norm) const {
  std::vector<train::ClippedTensor> pieces;
  for (const auto& [name, weight] : trained_) pieces.push_back({weight, writes(name)});
  return train::clip_grad_norm(pieces, max_norm,
                               [this](torch::Tensor squares) { return comm::all_reduce(world_, std::move(squares)); });
}

MESHTORCH_DECL torch::Tensor PipelineLlamaRuntime::mean_over_data_parallel(torch::Tensor value) const {
  if (!loss_mean_ || loss_mean_->size() == 1) return value;
  const auto shape = value.sizes().vec();
  return comm::all_reduce(*loss_mean_, value.reshape({1})).reshape(shape) / static_cast<double>(loss_mean_->size());
}

MESHTORCH_DECL std::string PipelineLlamaRuntime::layout() const {
  const auto& shape = runner_->table().shape;
  std::string text = fmt::format("{}: pipeline {} over PP ({} stages, {} per rank, {} micro-batches: {})", mesh_name_,
                                 pp::to_string(shape.kind), shape.stages(), shape.stages_per_rank, shape.microbatches,
                                 split_.describe());
  if (tp_) text += fmt::format(" -> tensor parallel over TP{}", sequence_parallel_ ? " (sequence parallel)" : "");
  if (cp_) text += fmt::format(" -> context parallel over CP ({})", cp::to_string(cp_->rotate()));
  if (fsdp_)
    text += fmt::format(" -> FSDP over {} ({} units on this rank)", cp_ ? "FSDP x CP" : "FSDP", fsdp_->units().size());
  if (replicas_ && replicas_->size() > 1) text += cp_ && !fsdp_ ? " -> DDP over DP x CP" : " -> DDP over DP";
  return text;
}

MESHTORCH_DECL std::int64_t PipelineLlamaRuntime::local_numel() const {
  std::int64_t numel = 0;
  for (const auto& [name, weight] : trained_) numel += weight.numel();
  return numel;
}

MESHTORCH_DECL std::string PipelineLlamaRuntime::summary() const {
  const auto counts = model_->config.parameter_counts();
  std::vector<std::string> stages;
  for (int s : local_stages_) stages.push_back(std::to_string(s));
  return fmt::format("{}; {} holds stage{} {}: {} of the model's {} parameters, {} (schedule --schedule {})", layout(),
                     coordinate_, stages.size() == 1 ? "" : "s", fmt::join(stages, ", "), local_numel(),
                     counts ? counts->total : 0,
                     trained_.empty() ? "float32" : llama::dtype_name(trained_.front().second.scalar_type()),
                     pp::schedule_flag(runner_->table().shape.kind));
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
