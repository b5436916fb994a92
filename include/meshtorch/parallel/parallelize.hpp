#pragma once
// parallelize(model, mesh, options): the mesh type builds the parallel model. The axes of the
// Mesh type decide, at compile time, which wrappers exist, and they are applied in torchtitan's
// order:
//
//   axis in the mesh type   applied                                                   over
//   TP                      the plan's styles: tensor + sequence + loss parallel      group<TP>()
//   CP                      attention over the split sequence, the loss of its chunks group<CP>()
//   (options)               activation checkpointing of the chosen decoder layers
//   FSDP                    fully_shard per decoder layer, then the root               group<FSDP, CP>()
//   DP                      replication: gradients all-reduced in buckets (DDP)        group<DP>()
//                           (with FSDP: HSDP, the shards' gradients all-reduced;
//                           with CP and no FSDP: over group<DP, CP>();
//                           with ZeroStage2Options: reduce-scattered, ZeRO-2)
//
// The data-parallel group (the sampler's) is DP and FSDP merged: the CP ranks of a replica read
// the same batch. The loss is averaged over DP, FSDP and CP merged (parallel/context_parallel.hpp). The model comes
// in on the meta device; no rank materialises more than its own pieces plus one full weight at a
// time: each weight is drawn whole (the same random numbers chapter 1 draws, so every layout
// starts from the same model) or read from the model folder, and only this rank's piece is kept.
// parallelize<Plan>(...) applies a named llama::Plan; docs/parallelize.md has the walk-through.
//
// The object owns the wrappers, whose hooks live in the model: keep it alive while the model runs.
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/sharded_tensor.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/models/llama/plan.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/context_parallel.hpp>
#include <meshtorch/parallel/data_parallel_groups.hpp>
#include <meshtorch/parallel/ddp.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/fsdp_llama.hpp>
#include <meshtorch/parallel/parallelize_options.hpp>
#include <meshtorch/parallel/pipeline_llama.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>
#include <meshtorch/parallel/weight_piece.hpp>
#include <meshtorch/parallel/zero_stage2.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/grad_clipping.hpp>
#include <meshtorch/train/memory.hpp>
#include <meshtorch/train/timers.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch {

// The groups of a DeviceMesh that ParallelLlama's wrappers use; an axis the mesh type lacks is
// absent.
struct ParallelGroups {
  comm::AxisGroup world;
  std::string_view mesh_name;  // "Mesh<FSDP<2>, TP<2>>"
  std::string coordinate;      // "rank 5 of 8 on cpu: DP 1 of 2, FSDP 0 of 2, TP 1 of 2"
  std::optional<comm::AxisGroup> tp, cp;
  // FSDP's, DDP's (replicas), the sampler's and the loss's groups.
  DataParallelGroups data;
  // This rank's node, where the node's local rank 0 reads the weights (WeightsReadBy::local_rank0).
  std::optional<comm::AxisGroup> node;
};

// What the mesh type's plan gives the run time: its TP styles as values and its checks.
struct ParallelPlan {
  const tp_detail::PlanSteps* tp_steps = nullptr;  // null without a TP axis
  // Refuses a config the styles cannot split at a TP size (llama::Plan::validate).
  void (*validate)(const llama::Config& config, std::int64_t tp_size, std::string_view source) = nullptr;
  // Refuses a sequence length the styles cannot split (llama::Plan::validate_sequence).
  void (*validate_sequence)(std::int64_t seq_length, std::int64_t tp_size) = nullptr;
  bool sequence_parallel = false;  // the styles cut the residual stream along the sequence over TP
  std::string wrappers;            // ParallelLlama::describe()
  // ZeRO-2 instead of DDP over DP: set only by the constructor that takes ZeroStage2Options,
  // which the mesh type allows (DP, no FSDP) at compile time.
  std::optional<ZeroStage2Options> zero_stage2;
};

// What ParallelLlama<Mesh> does, for the wrappers its mesh type chose (given as groups and the
// plan's values): one copy of the code in a program, however many mesh types it builds.
class ParallelLlamaRuntime {
 public:
  // Builds the wrappers over `groups` in torchtitan's order and fills this rank's pieces; see
  // the top of this header.
  MESHTORCH_DECL ParallelLlamaRuntime(llama::LlamaForCausalLM model, ParallelGroups groups,
                                      const ParallelizeOptions& options, ParallelPlan plan);
  ParallelLlamaRuntime(ParallelLlamaRuntime&&) noexcept = default;
  ParallelLlamaRuntime& operator=(ParallelLlamaRuntime&&) noexcept = default;
  MESHTORCH_DECL ~ParallelLlamaRuntime();

  // Mean next-token cross entropy of this rank's batch (vocab-parallel under loss parallel);
  // its backward runs every gradient collective of the layout.
  MESHTORCH_DECL torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels);

  // While the guard lives, backward accumulates gradients without the DP all-reduce (DDP's
  // no_sync): use it on all micro-batches of a step but the last. FSDP and ZeRO-2 still
  // reduce-scatter each micro-batch (as FSDP2 and DeepSpeed do), so no full gradient stays.
  class NoSync {
   public:
    explicit NoSync(ParallelLlamaRuntime& parallel) {
      if (parallel.ddp_) ddp_guard_.emplace(parallel.ddp_->no_sync());
    }

   private:
    std::optional<DistributedDataParallel::NoSync> ddp_guard_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // What the optimizer steps: the FSDP shards, ZeRO-2's rows, or the (TP-sharded) weights.
  MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;

  // The data-parallel coordinate and size (DP and FSDP merged): what the sampler splits the
  // global batch by. 0 and 1 on a mesh without either.
  int data_parallel_rank() const { return data_parallel_ ? data_parallel_->rank() : 0; }
  int data_parallel_size() const { return data_parallel_ ? data_parallel_->size() : 1; }
  const std::optional<comm::AxisGroup>& data_parallel() const { return data_parallel_; }
  // The mean of a per-rank value over the data-parallel group and CP (e.g. the step's loss, of
  // which each CP rank holds its chunks' share x CP); TP ranks hold the same value already.
  MESHTORCH_DECL torch::Tensor mean_over_data_parallel(torch::Tensor value) const;
  // --measure-waiting, the guide's barrier: the time this rank waits here for the slowest rank
  // of the job goes to the timers' "waiting" phase.
  MESHTORCH_DECL void wait_for_slowest(train::PhaseTimers& timers) const;

  // Where this rank's piece of a (HF-named) weight lies in the global weight: its TP chunk, then
  // its FSDP (or ZeRO-2) rows of that chunk. What checkpoints record, what initialisation keeps
  // and what loading reads.
  MESHTORCH_DECL io::Box piece_box(const std::string& name, const std::vector<std::int64_t>& global_shape) const;

  // This rank's piece of a full (HF-named) weight: a view, no copy.
  MESHTORCH_DECL torch::Tensor piece_of(const std::string& name, const torch::Tensor& full) const;

  // Every weight this rank trains as a box of the global weight, for checkpoints: its TP chunk,
  // then its FSDP (or ZeRO-2) rows. Of identical copies (DP replicas, weights TP leaves whole)
  // exactly one rank is the writer: DP coordinate 0 (every DP rank under ZeRO-2), TP rank 0.
  MESHTORCH_DECL std::vector<io::ShardedTensor> sharded_parameters() const;
  // Clips every gradient this rank trains so that the whole model's gradient norm is at most
  // `max_norm` (train/grad_clipping.hpp); returns the norm before clipping. Every rank calls
  // it, after backward and before the optimizer step.
  MESHTORCH_DECL double clip_grad_norm(double max_norm) const;

  // "Mesh<...>: tensor parallel over TP (...) -> ...", recorded in checkpoints.
  MESHTORCH_DECL std::string layout() const;
  // "rank 5 of 8 on cpu: DP 1 of 2, FSDP 0 of 2, TP 1 of 2".
  const std::string& coordinate() const { return coordinate_; }

  // Refuses a sequence length the layout cannot split (context parallel cuts it into 2 x CP
  // chunks, sequence parallel every rank's positions over TP); the data loader asks before it
  // packs the data.
  MESHTORCH_DECL void validate_sequence(std::int64_t seq_length) const;

  // "<describe()>: 3145728 of the model's 12582912 parameters held by this rank, float32".
  MESHTORCH_DECL std::string summary() const;

  // The global (unsharded) shape of every weight, by HF name, in the model's order.
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& global_shapes() const { return global_shapes_; }
  // Elements of weights this rank read from -m's folder (0 when initialised): its pieces, plus
  // the whole rows of weights TP cuts along dim 1.
  std::int64_t elements_read_from_folder() const { return read_elements_; }
  // How far this rank's resident set rose while parallelize built and filled its pieces, at the
  // peak: the pieces it keeps (on the CPU) plus what reading held at once.
  std::int64_t load_rss_growth_bytes() const { return load_rss_growth_; }
  // Elements of weights this rank holds, and their bytes.
  MESHTORCH_DECL std::int64_t local_numel() const;
  MESHTORCH_DECL std::int64_t local_bytes() const;
  // "weights from DIR read by rank0: this rank read 123 of the model's 456 elements; resident set
  // +78 MiB at the peak of loading, its pieces 70 MiB": the line a chapter logs after loading.
  MESHTORCH_DECL std::string load_report() const;

  llama::LlamaForCausalLM& module() { return model_; }
  const comm::AxisGroup& world() const { return world_; }
  TensorParallelRuntime* tensor_parallel() const { return tp_.get(); }
  ContextParallel* context_parallel() const { return cp_.get(); }
  FullyShardedDataParallel* fully_sharded() const { return fsdp_.get(); }
  DistributedDataParallel* data_parallel_replication() const { return ddp_.get(); }
  ZeroStage2* zero_stage2() const { return zero2_.get(); }
  const ParallelizeOptions& options() const { return options_; }

 protected:
  // ParallelLlama<M>::step_in_backward, once the mesh type has allowed it: the run-time refusals.
  MESHTORCH_DECL void step_units_in_backward(train::AdamW& optimizer, double max_grad_norm, std::int64_t micro_batches);

 private:
  // 5. DDP (or, with `zero_stage2`, ZeRO-2) over a DP axis of more than one rank.
  MESHTORCH_DECL void replicate(const comm::AxisGroup& dp, const std::optional<ZeroStage2Options>& zero_stage2);

  // Copies this rank's piece of a weight (in any dtype) into the tensor it trains.
  MESHTORCH_DECL static void keep_piece(const std::map<std::string, torch::Tensor>& trained, const std::string& name,
                                        const torch::Tensor& piece, const std::string& source);

  MESHTORCH_DECL std::map<std::string, torch::Tensor> trained_by_name() const;

  // HF's _init_weights over the global shapes, in chapter 1's order and with its random numbers.
  MESHTORCH_DECL void initialise(torch::ScalarType dtype);

  // An HF folder's weights, file by file (the index's shards): of each weight this rank reads
  // from disk only the rows its piece lies in (all of them where it keeps whole rows: TP's
  // dim-1 chunks), then converts to its dtype, so no rank reads a whole model or holds more than
  // its pieces plus one weight's rows. Every rank reads the folder itself: node-local copies or
  // a shared file system both work.
  MESHTORCH_DECL void load_weights(const std::filesystem::path& dir);

  // The rows of a folder's tensor that this rank's piece lies in: [first, first + count).
  MESHTORCH_DECL std::pair<std::int64_t, std::int64_t> rows_read_for(const io::SafetensorsEntry& entry) const;

  // The group's rank 0 (the world's, or each node's) reads each weight whole and broadcasts it
  // over the group; every rank keeps its piece. The reader checks every file first and sends the
  // list of weights, or what is wrong with them (list_folder_weights).
  MESHTORCH_DECL void load_weights_through(const std::filesystem::path& dir, const comm::AxisGroup& group);

  // Whether a folder's tensor is loaded: the rotary tables are recomputed and a tied head is the embedding.
  MESHTORCH_DECL bool is_loaded(const std::string& name) const;
  MESHTORCH_DECL void check_shape(const io::SafetensorsEntry& entry, const std::filesystem::path& file) const;
  MESHTORCH_DECL const std::vector<std::int64_t>* shape_of(const std::string& name) const;

  llama::LlamaForCausalLM model_;
  ParallelizeOptions options_;
  comm::AxisGroup world_;
  std::string_view mesh_name_;
  std::string coordinate_;
  std::string wrappers_;
  void (*validate_sequence_)(std::int64_t, std::int64_t) = nullptr;
  bool sequence_parallel_ = false;
  int replica_ = 0;                 // the rank among DDP's replicas: replicas other than 0 write nothing
  std::int64_t read_elements_ = 0;  // of weights read from a model folder (load_weights)
  std::int64_t load_rss_growth_ = 0;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> global_shapes_;
  std::optional<comm::AxisGroup> data_parallel_, loss_mean_;
  std::unique_ptr<TensorParallelRuntime> tp_;
  std::unique_ptr<ContextParallel> cp_;
  std::unique_ptr<FullyShardedDataParallel> fsdp_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<ZeroStage2> zero2_;
};

// The parallel model of a mesh type: checks the mesh and the styles at compile time, and hands
// ParallelLlamaRuntime the groups of the axes the type has and the plan's styles as values.
template <MeshType M, llama::LlamaStyles Styles = llama::default_styles<M>>
class ParallelLlama : public ParallelLlamaRuntime {
  static_assert(llama::check_parallelizable<M, Styles>());

 public:
  using mesh_type = M;
  using plan = llama::Plan<M, llama::detail::RunTimeConfig{}, Styles>;
  static constexpr bool has_tp = M::template has<TP>;
  static constexpr bool has_fsdp = M::template has<FSDP>;
  static constexpr bool has_dp = M::template has<DP>;
  static constexpr bool has_cp = M::template has<CP>;

  ParallelLlama(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh, ParallelizeOptions options)
      : ParallelLlamaRuntime(std::move(model), groups_of(mesh, options), options, plan_values()) {}

  // ZeRO-2 over DP instead of DDP (parallel/zero_stage2.hpp): each bucket's gradients are
  // reduce-scattered, every rank keeps and steps its rows of each weight, and the next forward
  // all-gathers them. Only a mesh with a DP axis and no FSDP may ask (a compile error otherwise).
  ParallelLlama(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh, ParallelizeOptions options,
                ZeroStage2Options zero_stage2)
      : ParallelLlamaRuntime(std::move(model), groups_of(mesh, options), options, plan_values(zero_stage2)) {
    static_assert(has_dp && !has_fsdp,
                  "ZeRO-2 (ZeroStage2Options) shards gradients and optimizer state over a DP axis and keeps "
                  "whole weights: it needs a mesh with DP and no FSDP, such as Mesh<DP<dynamic>>; FSDP already "
                  "shards gradients, optimizer state and weights (ZeRO-3), so drop ZeroStage2Options there");
  }

  // "TP(styles) -> FSDP per layer + root -> DDP": the wrappers this mesh type applied, for logs.
  static std::string describe() {
    std::string out;
    auto add = [&](const std::string& step) { out += (out.empty() ? "" : " -> ") + step; };
    if constexpr (has_tp) add("tensor parallel over TP (" + plan::describe_styles() + ")");
    if constexpr (has_cp) add("context parallel over CP (attention over the split sequence)");
    if constexpr (has_fsdp)
      add(has_cp ? "fully_shard per decoder layer, then the root, over FSDP x CP"
                 : "fully_shard per decoder layer, then the root, over FSDP");
    if constexpr (has_dp)
      add(has_fsdp ? "HSDP: shard gradients all-reduced over DP" : has_cp ? "DDP over DP x CP" : "DDP over DP");
    else if constexpr (has_cp && !has_fsdp)
      add("DDP over CP");
    return out.empty() ? "no wrapper (one rank)" : out;
  }

  // Steps `optimizer` in backward (torchtune's optimizer_in_bwd): each FSDP unit's shards as soon
  // as their reduce-scattered gradients are in, after which those gradients are freed; so a rank
  // holds one unit's gradient shards at a time, not the whole model's. Every element gets the
  // update optimizer.step() would give it. The loop then sets the learning rate before the step's
  // forward and calls neither step() nor clipping. Only a mesh of FSDP alone may ask (a compile
  // error otherwise); refused at run time (ConfigError naming the flag) with what needs every
  // gradient before any update: clipping by the global norm (max_grad_norm > 0) and accumulation
  // over micro_batches > 1. `optimizer` must outlive every backward.
  void step_in_backward(train::AdamW& optimizer, double max_grad_norm, std::int64_t micro_batches) {
    static_assert(has_fsdp && !has_tp && !has_dp,
                  "step_in_backward (--optimizer-in-backward) needs a mesh of FSDP alone, Mesh<FSDP<...>>: "
                  "tensor parallel sums the norms' gradients after backward, and DP replicas (DDP, HSDP) "
                  "all-reduce after it, so no unit's gradient is final when its backward ends; drop the "
                  "flag or the other axes");
    step_units_in_backward(optimizer, max_grad_norm, micro_batches);
  }

 private:
  static constexpr const tp_detail::PlanSteps& tp_steps = tp_detail::plan_steps_if_tp<plan>;

  static ParallelPlan plan_values(std::optional<ZeroStage2Options> zero_stage2 = std::nullopt) {
    return {.tp_steps = has_tp ? &tp_steps : nullptr,
            .validate = has_tp ? &plan::validate : nullptr,
            .validate_sequence = &plan::validate_sequence,
            .sequence_parallel = has_tp && plan::sequence_parallel,
            .wrappers = describe(),
            .zero_stage2 = zero_stage2};
  }

  static ParallelGroups groups_of(const comm::DeviceMesh<M>& mesh, const ParallelizeOptions& options) {
    ParallelGroups groups{.world = mesh.world(), .mesh_name = M::name, .coordinate = mesh.describe()};
    if constexpr (has_tp) groups.tp = mesh.template group<TP>();
    if constexpr (has_cp) groups.cp = mesh.template group<CP>();
    groups.data = data_parallel_groups(mesh);
    // Only asked for when it reads: a job without a node group may still read otherwise.
    if (options.weights_read_by == WeightsReadBy::local_rank0) groups.node = mesh.node();
    return groups;
  }
};

// Builds the parallel model for the mesh type M from a model on the meta device: with the guide's
// plan (default_styles<M>), with a plan type (parallelize<llama::Plan<M, ...>>, the type launch<P>()
// described at start-up), or with styles alone.
template <llama::LlamaPlan P, MeshType M>
ParallelLlama<M, typename P::styles> parallelize(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh,
                                                 ParallelizeOptions options = {}) {
  static_assert(std::is_same_v<typename P::mesh_type, M>,
                "parallelize<Plan>: the plan was made for another mesh type than the mesh given; name the "
                "program's mesh in the plan (llama::Plan<Mesh, ...>) and launch<Plan>() with it");
  return ParallelLlama<M, typename P::styles>(std::move(model), mesh, std::move(options));
}
template <llama::LlamaStyles Styles, MeshType M>
ParallelLlama<M, Styles> parallelize(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh,
                                     ParallelizeOptions options = {}) {
  return ParallelLlama<M, Styles>(std::move(model), mesh, std::move(options));
}
// A mesh with a PP axis gets the pipeline model (parallel/pipeline_llama.hpp).
template <MeshType M>
auto parallelize(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh, ParallelizeOptions options = {}) {
  if constexpr (M::template has<PP>)
    return PipelineLlama<M>(std::move(model), mesh, options);
  else
    return ParallelLlama<M>(std::move(model), mesh, std::move(options));
}
// ZeRO-2 over the DP axis instead of DDP: a mesh with DP and no FSDP (ParallelLlama's constructor
// says so at compile time), and no PP.
template <MeshType M>
ParallelLlama<M> parallelize(llama::LlamaForCausalLM model, const comm::DeviceMesh<M>& mesh, ParallelizeOptions options,
                             ZeroStage2Options zero_stage2) {
  static_assert(!M::template has<PP>,
                "ZeRO-2 (ZeroStage2Options) on a mesh with PP: pipeline stages replicate over DP with DDP; "
                "drop ZeroStage2Options or the PP axis");
  return ParallelLlama<M>(std::move(model), mesh, std::move(options), zero_stage2);
}

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <nlohmann/json.hpp>

#include <meshtorch/parallel/parallel_llama_weights.hpp>

namespace meshtorch {

MESHTORCH_DECL ParallelLlamaRuntime::ParallelLlamaRuntime(llama::LlamaForCausalLM model, ParallelGroups groups,
                                                          const ParallelizeOptions& options, ParallelPlan plan)
    : model_(std::move(model)),
      options_(options),
      world_(std::move(groups.world)),
      mesh_name_(groups.mesh_name),
      coordinate_(std::move(groups.coordinate)),
      wrappers_(std::move(plan.wrappers)),
      validate_sequence_(plan.validate_sequence),
      sequence_parallel_(plan.sequence_parallel),
      replica_(groups.data.replica),
      data_parallel_(std::move(groups.data.data_parallel)),
      loss_mean_(std::move(groups.data.loss_mean)) {
  // What building and filling the pieces adds to the resident set at its peak is kept: the
  // measure that no rank held the whole model.
  const auto rss_before_build = train::rss_bytes();
  train::reset_peak_rss();
  options_.fsdp.device = options_.device;
  if (groups.tp) plan.validate(model_->config, groups.tp->size(), options_.model_name);
  const auto dtype = model_->parameters().front().scalar_type();
  for (const auto& tensor : leaf_tensors(*model_)) {
    if (!tensor.tensor().is_meta())
      throw ConfigError(
          fmt::format("parallelize: '{}' is not on the meta device; build the model with "
                      "torch::TensorOptions().device(torch::kMeta) so that no rank holds it whole",
                      tensor.name));
    global_shapes_.emplace_back(tensor.name, tensor.tensor().sizes().vec());
  }

  // 1. Tensor parallel: each rank keeps its TP chunk of every matrix (still on meta).
  if (groups.tp) tp_ = std::make_unique<TensorParallelRuntime>(model_, *groups.tp, *plan.tp_steps);

  // 1b. Context parallel: every attention over the split sequence, the loss of this rank's chunks.
  if (groups.cp) cp_ = std::make_unique<ContextParallel>(model_, *groups.cp, options_.cp_rotate);

  // 2. Activation checkpointing: inside each chosen layer's hooks, so FSDP's gather is not redone.
  checkpoint_activations(model_, options_.activation_checkpointing);
  model_->loss_chunk = options_.loss_chunk;
  model_->use_fused_kernels(options_.fused_kernels);

  // 3. FSDP: a unit per decoder layer, then the root; the shards are allocated, the rest not.
  if (groups.data.fsdp) {
    // Under HSDP, DDP's Reducer all-reduces the shards' gradients as autograd delivers them:
    // the reduce-scatters hand their results to autograd at once instead of staying in flight.
    if (groups.data.replicas && groups.data.replicas->size() > 1) options_.fsdp.reduce_scatters_in_flight = 0;
    fsdp_ = std::make_unique<FullyShardedDataParallel>(model_, *groups.data.fsdp, options_.fsdp,
                                                       llama_fsdp_adapter(model_->config));
    // As torchtitan: the last layer keeps its weights from forward to backward, which starts
    // with it (resharding would free them only to gather them again at once).
    auto& layers = model_->model->decoder_layers;
    for (std::size_t i = 0; i < layers.size(); ++i)
      fsdp_->fully_shard(layers[i], i + 1 < layers.size() ? std::nullopt : std::optional<bool>(false));
    fsdp_->fully_shard(model_);
  } else {
    for (auto& [name, leaf] : weight_modules(*model_))
      leaf->materialize(torch::TensorOptions().device(options_.device).dtype(dtype));
  }

  // 4. Fill this rank's pieces, one full weight at a time.
  if (options_.weights_from.empty())
    initialise(dtype);
  else if (options_.weights_read_by == WeightsReadBy::rank0)
    load_weights_through(options_.weights_from, world_);
  else if (options_.weights_read_by == WeightsReadBy::local_rank0)
    load_weights_through(options_.weights_from, *groups.node);
  else
    load_weights(options_.weights_from);
  load_rss_growth_ = train::peak_rss_bytes() - rss_before_build;

  // 5. Replication over DP: DDP's bucketed all-reduce of whatever this rank trains (nothing to
  //    do for a DP axis of one rank).
  if (groups.data.replicas) {
    if (groups.data.replicas->size() > 1) replicate(*groups.data.replicas, plan.zero_stage2);
  }
  // The sequence-parallel norms' gradients are summed over TP where the optimizer reads them.
  if (tp_) tp_->sum_norm_gradients_into(trained_by_name());
}

MESHTORCH_DECL ParallelLlamaRuntime::~ParallelLlamaRuntime() = default;

MESHTORCH_DECL void ParallelLlamaRuntime::replicate(const comm::AxisGroup& dp,
                                                    const std::optional<ZeroStage2Options>& zero_stage2) {
  std::vector<std::pair<std::string, torch::Tensor>> replicated;
  for (auto& [name, tensor] : named_parameters())
    if (tensor.numel() > 0) replicated.emplace_back(name, tensor);
  if (fsdp_ && options_.fsdp.cpu_offload && options_.device.is_cuda())
    throw ConfigError(
        "parallelize: cpu_offload on an HSDP mesh (DP and FSDP) is not supported yet: the "
        "offloaded shards cannot be all-reduced over the DP axis's NCCL group");
  if (zero_stage2)
    zero2_ = std::make_unique<ZeroStage2>(std::move(replicated), dp, *zero_stage2);
  else
    ddp_ = std::make_unique<DistributedDataParallel>(std::move(replicated), dp, options_.ddp);
}

MESHTORCH_DECL torch::Tensor ParallelLlamaRuntime::loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
  auto compute = [&] {
    auto loss = cp_ ? cp_->loss(input_ids, labels) : model_->loss(input_ids, labels);
    return tp_ ? tp_->start_backward_at(loss) : loss;
  };
  if (ddp_) return (*ddp_)(compute);
  if (zero2_) zero2_->before_forward();  // the rows other ranks updated
  return compute();
}

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> ParallelLlamaRuntime::named_parameters() const {
  if (zero2_) return zero2_->named_shards();
  if (fsdp_) return fsdp_->named_parameters();
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : model_->named_parameters()) named.emplace_back(item.key(), item.value());
  return named;
}

MESHTORCH_DECL torch::Tensor ParallelLlamaRuntime::mean_over_data_parallel(torch::Tensor value) const {
  if (!loss_mean_) return value;
  return comm::all_reduce(*loss_mean_, std::move(value), comm::ReduceOp::avg);
}

MESHTORCH_DECL void ParallelLlamaRuntime::validate_sequence(std::int64_t seq_length) const {
  const std::int64_t tp = tp_ && sequence_parallel_ ? tp_->group().size() : 1;
  if (cp_)
    cp_->validate_sequence(seq_length, tp);  // names both rules
  else if (tp_)
    validate_sequence_(seq_length, tp_->group().size());
}

MESHTORCH_DECL void ParallelLlamaRuntime::wait_for_slowest(train::PhaseTimers& timers) const {
  auto timer = timers.time("waiting");
  comm::barrier(world_);
}

MESHTORCH_DECL io::Box ParallelLlamaRuntime::piece_box(const std::string& name,
                                                       const std::vector<std::int64_t>& global_shape) const {
  auto box = tp_fsdp_piece(name, global_shape, tp_.get(), fsdp_.get());
  if (zero2_) {
    const auto [first_row, rows] = zero2_->rows_of(name);
    box = io::rows(box, first_row, first_row + rows);
  }
  return box;
}

MESHTORCH_DECL torch::Tensor ParallelLlamaRuntime::piece_of(const std::string& name, const torch::Tensor& full) const {
  const auto shape = full.sizes().vec();
  return io::view_of(full, io::whole(shape), piece_box(name, shape));
}

MESHTORCH_DECL std::vector<io::ShardedTensor> ParallelLlamaRuntime::sharded_parameters() const {
  const auto trained = trained_by_name();
  std::vector<io::ShardedTensor> pieces;
  for (const auto& [name, shape] : global_shapes_) {
    bool writer = replica_ == 0 || zero2_;
    if (tp_ && !tp_->shard_dim(name)) writer = writer && tp_->group().rank() == 0;
    pieces.push_back(io::sharded(name, trained.at(name), shape, piece_box(name, shape), writer));
  }
  return pieces;
}

MESHTORCH_DECL double ParallelLlamaRuntime::clip_grad_norm(double max_norm) const {
  std::vector<train::ClippedTensor> pieces;
  for (auto& piece : sharded_parameters()) pieces.push_back({piece.local, piece.writer});
  return train::clip_grad_norm(pieces, max_norm, [this](const torch::Tensor& squares) {
    // Under CPU offload the gradients, and so their squares, are on the host; the sum goes over
    // the world's device (NCCL's GPU) and comes back.
    const torch::Device on(world_.device_name());
    return comm::all_reduce(world_, squares.to(on), comm::ReduceOp::sum).to(squares.device());
  });
}

MESHTORCH_DECL void ParallelLlamaRuntime::step_units_in_backward(train::AdamW& optimizer, double max_grad_norm,
                                                                 std::int64_t micro_batches) {
  const auto refuse = [&](const std::string& why) {
    throw ConfigError(fmt::format("--optimizer-in-backward on rank {}: {}", world_.rank(), why));
  };
  if (max_grad_norm > 0)
    refuse(
        fmt::format("clipping by the global norm (--max-grad-norm {}) needs every gradient before any update; "
                    "drop one of the two",
                    max_grad_norm));
  if (micro_batches > 1)
    refuse(
        fmt::format("{} micro-batches per step (--grad-accum or --global-batch-size) sum their gradients "
                    "before the update; use one",
                    micro_batches));
  if (!fsdp_) refuse(fmt::format("the layout is {}, without FSDP units to step", mesh_name_));
  fsdp_->on_gradients_ready([&optimizer](const std::vector<torch::Tensor>& shards) {
    optimizer.step(shards);
    for (const auto& shard : shards) shard.mutable_grad() = torch::Tensor();
  });
}

MESHTORCH_DECL std::string ParallelLlamaRuntime::layout() const {
  return fmt::format("{}: {}", mesh_name_,
                     zero2_ ? "ZeRO-2 over DP (gradients and optimizer state sharded)" : wrappers_);
}

MESHTORCH_DECL std::string ParallelLlamaRuntime::summary() const {
  return fmt::format("{}{}: {} of the model's {} parameters held by this rank, {}", wrappers_,
                     zero2_ ? " (ZeRO-2: gradients reduce-scattered)" : "", local_numel(),
                     model_->config.num_parameters(), llama::dtype_name(model_->parameters().front().scalar_type()));
}

MESHTORCH_DECL std::int64_t ParallelLlamaRuntime::local_numel() const {
  std::int64_t n = 0;
  for (const auto& [name, tensor] : named_parameters()) n += tensor.numel();
  return n;
}

MESHTORCH_DECL std::int64_t ParallelLlamaRuntime::local_bytes() const {
  std::int64_t n = 0;
  for (const auto& [name, tensor] : named_parameters()) n += tensor.numel() * tensor.element_size();
  return n;
}

MESHTORCH_DECL std::map<std::string, torch::Tensor> ParallelLlamaRuntime::trained_by_name() const {
  const auto named = named_parameters();
  return {named.begin(), named.end()};
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
