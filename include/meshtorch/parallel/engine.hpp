#pragma once
// meshtorch::Engine: DeepSpeed's engine (deepspeed.initialize) over parallelize(). One JSON
// config (train/deepspeed_config.hpp) says the micro batch, the accumulation, AdamW, the schedule,
// bf16, clipping and the ZeRO stage; the engine builds the parallel model, the optimizer and the
// schedule from it and takes over what the plain loop spells out:
//
//   stage   the mesh                 what it shards                     built from
//   0       Mesh<DP<dynamic>>        nothing (replicas)                 DDP
//   1       Mesh<DP<dynamic>>        optimizer state                    DDP + ZeroRedundancyOptimizer
//   2       Mesh<DP<dynamic>>        + gradients                        ZeroStage2
//   3       Mesh<FSDP<dynamic>>      + weights                          FSDP per decoder layer + root
//
//   return mt::initialize(args, config, [&](auto& engine) {       // picks the mesh for the stage
//     auto state = engine.load_checkpoint();                       // the latest of -e, or step 0
//     ... auto loss = engine.loss(ids, ids);                       // one micro-batch
//         engine.backward(loss);                                   // scaled by 1 / accumulation
//         if (engine.step(state, progress))                        // the optimizer, at a boundary
//           if (engine.checkpoint_due(state)) engine.save_checkpoint(state);
//   });
//
// Every rank builds the same engine from the same file (its canonical text is in the start-up
// fingerprint, so ranks with different configs stop at once, naming the difference).
//
// Link requirements: meshtorch::tracking (its Experiment writes TensorBoard files with --tensorboard).
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/parallelize.hpp>
#include <meshtorch/parallel/zero.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/deepspeed_config.hpp>
#include <meshtorch/train/experiment.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/lr_schedule.hpp>
#include <meshtorch/train/optimizer.hpp>
#include <meshtorch/train/state.hpp>
#include <meshtorch/train/tensorboard.hpp>
#include <meshtorch/train/timers.hpp>

namespace meshtorch {

// Bytes of model state one rank holds: weights, gradients and optimizer state, each counted once
// per storage (views into one bucket or flat buffer count the buffer once).
struct ModelStateBytes {
  std::int64_t weights = 0;
  std::int64_t gradients = 0;
  std::int64_t optimizer = 0;
  std::int64_t total() const { return weights + gradients + optimizer; }
};

// The training flags with the config's values in place of -b, --grad-accum, --lr, --dtype and
// --max-grad-norm, for `data_parallel` ranks; what launch() fingerprints and the data loader reads.
MESHTORCH_DECL train::TrainArgs engine_args(train::TrainArgs args, train::DeepSpeedConfig& config,
                                            std::int64_t data_parallel);

template <MeshType M>
class Engine {
 public:
  static constexpr bool shards_weights = M::template has<FSDP>;
  using Model = ParallelLlama<M>;

  Engine(const train::TrainArgs& args, train::DeepSpeedConfig config)
      : config_(check_mesh(std::move(config))),
        args_(engine_args(args, config_, comm::launch_env().world_size)),
        run_(launch<M>(args_, {}, "|deepspeed=" + config_.canonical)),
        model_(build_model()),
        optimizer_(build_optimizer()),
        schedule_(config_.schedule()),
        experiment_(args_, run_.mesh.rank(), *config_.train_batch_size, run_.device,
                    train::tensorboard_tracker(args_, run_.mesh.rank())),
        timers_(run_.device),
        step_loss_(zero_loss()) {
    run_.log.info(
        fmt::format("engine: ZeRO stage {} ({}) over {} ranks: micro batch {} per rank, {} accumulation "
                    "steps, train batch {}, {}{}{}",
                    config_.zero_stage, describe_stage(config_.zero_stage), run_.mesh.world_size(), args_.batch_size,
                    args_.grad_accum, *config_.train_batch_size, config_.bf16 ? "bf16" : "fp32",
                    config_.gradient_clipping > 0 ? fmt::format(", clipping at {}", config_.gradient_clipping) : "",
                    config_.offload_param       ? ", shards offloaded to the CPU"
                    : config_.offload_optimizer ? ", AdamW's state and step offloaded to the CPU"
                                                : ""));
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // The loss of one micro-batch (mean over its tokens). On all micro-batches of a step but the
  // last, DDP's all-reduce waits (no_sync) so gradients accumulate locally first.
  torch::Tensor loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
    auto timer = timers_.time("forward");
    std::optional<typename Model::NoSync> no_sync;
    if (!is_gradient_accumulation_boundary()) no_sync.emplace(model_.no_sync());
    return model_.loss(input_ids, labels);
  }

  // Backward of a micro-batch's loss, scaled by 1 / gradient_accumulation_steps as DeepSpeed's.
  void backward(const torch::Tensor& loss) {
    auto timer = timers_.time("backward");
    const auto scaled = loss / static_cast<double>(args_.grad_accum);
    scaled.backward();
    step_loss_ = step_loss_ + scaled.detach().to(torch::kDouble);  // no host sync per micro-batch
    ++micro_step_;
  }

  bool is_gradient_accumulation_boundary() const { return (micro_step_ + 1) % args_.grad_accum == 0; }

  // At an accumulation boundary: clip, set the scheduled rate, step the optimizer (and gather or
  // broadcast what the stage needs), end the step in `state` (loss, progress, the metrics line
  // every steps_per_print), and return true. Between boundaries it does nothing and returns false.
  bool step(train::TrainState& state, train::ProgressBar& progress) {
    if (micro_step_ % args_.grad_accum != 0) return false;
    {
      auto timer = timers_.time("update");
      if (config_.gradient_clipping > 0) state.grad_norm = model_.clip_grad_norm(config_.gradient_clipping);
      optimizer_->set_lr(schedule_.lr_at(state.global_step));
      optimizer_->step();
      if (!measured_) {
        measured_ = measure_model_state();
        run_.log.info(fmt::format(
            "model state on this rank at the first step: weights {:.1f} MB, gradients {:.1f} MB, "
            "optimizer state {:.1f} MB, total {:.1f} MB",
            mb(measured_->weights), mb(measured_->gradients), mb(measured_->optimizer), mb(measured_->total())));
      }
      optimizer_->zero_grad();
    }
    const double loss = model_.mean_over_data_parallel(step_loss_).template item<double>();
    step_loss_ = zero_loss();
    experiment_.end_step(state, loss, progress);
    if (state.global_step % args_.log_freq == 0)
      experiment_.log_metrics(state, steps_per_epoch_, schedule_.lr_at(state.global_step), timers_);
    return true;
  }

  // The run's checkpoint: the latest of <save-dir>/<-e> (or --resume-from), restored into the
  // model and optimizer; a fresh state without one.
  train::TrainState load_checkpoint() { return experiment_.resume(model_, *optimizer_); }
  // Saves <save-dir>/<-e>/ckpt-<global_step>: every rank its own pieces (collective).
  void save_checkpoint(const train::TrainState& state) { experiment_.save(state, model_, *optimizer_); }
  bool checkpoint_due(const train::TrainState& state) const {
    return experiment_.checkpoint_due(state, steps_per_epoch_);
  }

  // The data loader's epoch length, for the metrics and the end-of-run checkpoint.
  void set_steps_per_epoch(std::int64_t steps) { steps_per_epoch_ = steps; }

  // Model state held by this rank after the first optimizer step (before its zero_grad).
  const std::optional<ModelStateBytes>& model_state() const { return measured_; }

  Model& model() { return model_; }
  const train::TrainArgs& args() const { return args_; }
  const train::DeepSpeedConfig& config() const { return config_; }
  const comm::DeviceMesh<M>& mesh() const { return run_.mesh; }
  torch::Device device() const { return run_.device; }
  const train::Logger& log() const { return run_.log; }
  train::PhaseTimers& timers() { return timers_; }

  static std::string describe_stage(int stage) {
    switch (stage) {
      case 0:
        return "DDP: nothing sharded";
      case 1:
        return "ZeroRedundancyOptimizer: optimizer state sharded";
      case 2:
        return "ZeroStage2: gradients and optimizer state sharded";
      default:
        return "FSDP: weights, gradients and optimizer state sharded";
    }
  }

 private:
  torch::Tensor zero_loss() const {
    return torch::zeros({}, torch::TensorOptions().device(run_.device).dtype(torch::kDouble));
  }
  static double mb(std::int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

  static train::DeepSpeedConfig check_mesh(train::DeepSpeedConfig config) {
    if (config.zero_stage == 3 && !shards_weights)
      throw ConfigError(
          fmt::format("{}: zero_optimization.stage: 3 shards the weights, which needs a mesh with an FSDP "
                      "axis; this engine's mesh is {} (meshtorch::initialize picks Mesh<FSDP<dynamic>> "
                      "for stage 3){}",
                      config.file, std::string(M::name),
                      config.offload_param ? "; zero_optimization.offload_param offloads those shards" : ""));
    if (config.zero_stage < 3 && (shards_weights || !M::template has<DP>))
      throw ConfigError(
          fmt::format("{}: zero_optimization.stage: {} keeps whole weights on every rank, which needs a "
                      "mesh with a DP axis and no FSDP; this engine's mesh is {}",
                      config.file, config.zero_stage, std::string(M::name)));
    return config;
  }

  Model build_model() {
    const auto llama_config = llama::resolve_model(args_.model_name);
    const auto dtype = shards_weights ? torch::kFloat : run_.dtype;  // stage 3: fp32 shards, bf16 compute
    auto options = parallelize_options(args_, run_.device);
    if (config_.reduce_bucket_size)
      options.ddp.bucket_cap_mb =
          static_cast<double>(*config_.reduce_bucket_size * c10::elementSize(dtype)) / (1024.0 * 1024.0);
    options.fsdp = {.cpu_offload = config_.offload_param,
                    .mixed_precision = {.param_dtype = run_.dtype, .reduce_dtype = torch::kFloat}};
    llama::LlamaForCausalLM model(llama_config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
    if constexpr (!shards_weights)
      if (config_.zero_stage == 2) {
        const ZeroStage2Options zero_stage2{.bucket_cap_mb = options.ddp.bucket_cap_mb,
                                            .buckets_in_flight = config_.overlap_comm ? 2 : 0};
        return parallelize(std::move(model), run_.mesh, std::move(options), zero_stage2);
      }
    return parallelize(std::move(model), run_.mesh, std::move(options));
  }

  std::unique_ptr<train::Optimizer> build_optimizer() {
    const auto named = model_.named_parameters();
    if constexpr (!shards_weights)
      if (config_.zero_stage == 1 && run_.mesh.world_size() > 1)
        return std::make_unique<ZeroRedundancyOptimizer>(named, run_.mesh.template group<DP>(), config_.optimizer);
    return std::make_unique<train::AdamW>(named, config_.optimizer);
  }

  ModelStateBytes measure_model_state() {
    ModelStateBytes bytes;
    std::set<const void*> seen;
    auto add = [&](std::int64_t& into, const torch::Tensor& t) {
      if (!t.defined() || t.numel() == 0) return;
      const auto* storage = t.storage().unsafeGetStorageImpl();
      if (seen.insert(storage).second) into += static_cast<std::int64_t>(t.storage().nbytes());
    };
    for (const auto& p : model_.module()->parameters()) add(bytes.weights, p);
    for (const auto& [name, p] : model_.named_parameters()) add(bytes.weights, p);
    // Under stage 3 the module's weights are views of gathered buffers, not leaves: they hold no
    // gradient, and asking a non-leaf for one makes LibTorch warn (78 times in 8 steps).
    for (const auto& p : model_.module()->parameters())
      if (p.is_leaf()) add(bytes.gradients, p.grad());
    for (const auto& [name, p] : model_.named_parameters()) add(bytes.gradients, p.grad());
    for (const auto& [name, t] : optimizer_->state()) add(bytes.optimizer, t);
    return bytes;
  }

  train::DeepSpeedConfig config_;
  train::TrainArgs args_;
  Launch<M> run_;
  Model model_;
  std::unique_ptr<train::Optimizer> optimizer_;  // AdamW, or ZeRO-1's for stage 1
  train::LrSchedule schedule_;
  train::Experiment experiment_;
  train::PhaseTimers timers_;
  std::int64_t micro_step_ = 0;
  torch::Tensor step_loss_;  // the step's loss so far, summed over its micro-batches
  std::int64_t steps_per_epoch_ = 1;
  std::optional<ModelStateBytes> measured_;
};

// deepspeed.initialize: builds the engine for the config's stage (a DP mesh for stages 0-2, an
// FSDP mesh for 3) and runs `train(engine)` with it.
template <class Train>
int initialize(const train::TrainArgs& args, const train::DeepSpeedConfig& config, Train&& train) {
  if (config.zero_stage == 3) {
    Engine<Mesh<FSDP<dynamic>>> engine(args, config);
    return train(engine);
  }
  Engine<Mesh<DP<dynamic>>> engine(args, config);
  return train(engine);
}

}  // namespace meshtorch

#if MESHTORCH_DEFINES(tracking)
namespace meshtorch {

MESHTORCH_DECL train::TrainArgs engine_args(train::TrainArgs args, train::DeepSpeedConfig& config,
                                            std::int64_t data_parallel) {
  // The step profiler is train::Loop's, which the engine does not run: a flag that would do nothing is refused.
  if (!args.profile_dir.empty())
    throw ConfigError(
        "--profile: the engine does not profile its steps yet (chapters 1-7 and 9-12 do, through "
        "train::Loop)");
  config.resolve_batch(data_parallel);
  args.batch_size = *config.micro_batch_per_gpu;
  args.grad_accum = *config.gradient_accumulation_steps;
  args.global_batch_size = 0;
  args.lr = config.optimizer.lr;
  args.max_grad_norm = config.gradient_clipping;
  args.dtype = config.bf16 ? "bfloat16" : "float32";
  return args;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(tracking)
