#pragma once
// The parts of a training loop that every chapter repeats, as named calls, so that each chapter
// keeps its loop in view, top to bottom, as the guide's scripts and llm.c do, and writes out only
// what its chapter is about (DDP's no_sync, FSDP's step in backward, a fault):
//
//   mt::train::Loop loop(args, model, optimizer, blocks, sampler, rank, device);
//   for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
//     for (const auto& batch : loop.micro_batches())  // the "data" phase, no_sync but on the last
//       loop.backward(loop.timed("forward", [&] { return model.loss(batch.input_ids, batch.input_ids); }));
//     loop.timed("update", [&] { loop.update(state); });  // clip, the scheduled rate, step, zero_grad
//   }
//
// It owns what the guide's script keeps beside the loop: the learning-rate schedule, the phase
// timers, the experiment folder (metrics, checkpoints, resuming), the epochs (train::Epochs:
// each one's loader and progress bar), with --eval-freq the loss on the held-out blocks
// (train/evaluation.hpp) and, with --profile, the step profiler (train/profiler.hpp).
// The model, the optimizer and the data stay the chapter's. Chapter 8's engine
// (parallel/engine.hpp) makes the same calls for a DeepSpeed config, a micro-batch at a time.
//
// Link requirements: meshtorch::tracking (its Experiment writes TensorBoard files with --tensorboard).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/sampler.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/train/core_workers.hpp>
#include <meshtorch/train/epochs.hpp>
#include <meshtorch/train/evaluation.hpp>
#include <meshtorch/train/experiment.hpp>
#include <meshtorch/train/grad_clipping.hpp>
#include <meshtorch/train/lr_schedule.hpp>
#include <meshtorch/train/optimizer.hpp>
#include <meshtorch/train/profiler.hpp>
#include <meshtorch/train/state.hpp>
#include <meshtorch/train/tensorboard.hpp>
#include <meshtorch/train/timers.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch::train {

// `Model`: chapter 1's llama::LlamaForCausalLM, or a model parallelize() built (whose loss is
// averaged over the data-parallel ranks and whose clipping sees every rank's piece).
template <class Model>
class Loop {
  static constexpr bool has_no_sync = requires(Model & model) { model.no_sync(); };
  // The no_sync guard of a model that has one (a parallel model); chapter 1's has none.
  template <class M>
  struct NoSyncOf {
    using type = std::monostate;
  };
  template <class M>
  requires requires(M& model) { model.no_sync(); }
  struct NoSyncOf<M> {
    using type = decltype(std::declval<M&>().no_sync());
  };
  using NoSyncGuard = typename NoSyncOf<Model>::type;
  // Chapter 1's model (a module holder), not a parallel one: forward_backward may split its batch.
  static constexpr bool single_process_model = requires(Model & model, const torch::Tensor& ids) {
    model->loss(ids, ids);
  };

 public:
  // The schedule peaks at the rate `optimizer` was built with (chapter 2's may be scaled).
  Loop(const TrainArgs& args, Model& model, Optimizer& optimizer, const data::TokenBlocks& blocks,
       const data::DpInvariantSampler& sampler, int rank, torch::Device device)
      : args_(args),
        model_(model),
        optimizer_(optimizer),
        micro_batches_(sampler.micro_batches()),
        device_(device),
        schedule_(lr_schedule(args, sampler.steps_per_epoch(), optimizer.lr())),
        experiment_(args, rank, sampler.global_batch(), device, tensorboard_tracker(args, rank)),
        timers_(device),
        step_loss_(zero_loss()),
        epochs_(args, blocks, sampler, rank, device),
        profiler_(args, rank, experiment_.log()),
        held_out_(blocks.held_out()),
        data_parallel_size_(sampler.options().dp_size),
        data_parallel_rank_(sampler.options().dp_rank) {
    start_core_workers();
    if (args.eval_freq == 0) return;
    check_can_evaluate<Model>(args.eval_freq);
    if (!held_out_)
      throw ConfigError(fmt::format(
          "--eval-freq {}: no blocks are held out to evaluate on (--eval-split is 0, or the program did not load its "
          "blocks with load_training_data); give --eval-split above 0",
          args.eval_freq));
    check_enough_held_out(held_out_->size(), data_parallel_size_);  // now, not after --eval-freq steps
  }

  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  // The state of the checkpoint the run starts from (the model and optimizer restored), or a
  // fresh one: Experiment::resume.
  TrainState resume() { return experiment_.resume(model_, optimizer_); }

  // Whether another optimizer step follows: false after the last epoch and at --max-steps
  // (Epochs::next_step, which moves `state` to the next epoch at an epoch's end). With --profile
  // the profiler starts as its step begins, or writes what it holds as the run ends.
  bool next_step(TrainState& state) {
    const bool more = epochs_.next_step(state);
    if (more)
      profiler_.begin_step(state.global_step + 1);
    else
      profiler_.end_run();
    return more;
  }

  // This rank's next micro-batch on the device: the "data" phase. With --measure-waiting, the
  // step's first micro-batch then waits for the slowest rank (the guide's waiting time).
  torch::Tensor next_batch() {
    auto input_ids = timers_.timed("data", [&] { return epochs_.next_batch(); });
    if constexpr (requires { model_.wait_for_slowest(timers_); })
      if (args_.measure_waiting && micro_batch_ == 0) model_.wait_for_slowest(timers_);
    ++micro_batch_;
    return input_ids;
  }

  // One micro-batch of a step: this rank's batch and, on all but the step's last, the model's
  // no_sync guard (DDP's), which ends with the loop's iteration, so that only the last
  // micro-batch's backward all-reduces the gradients summed so far (chapter 2 spells it out).
  class MicroBatch {
   public:
    torch::Tensor input_ids;

    MicroBatch(Loop& loop, bool last) {
      if constexpr (has_no_sync)
        if (!last) no_sync_.emplace(loop.model_.no_sync());
      input_ids = loop.next_batch();
    }

   private:
    std::optional<NoSyncGuard> no_sync_;
  };

  // The step's micro-batches (--grad-accum of them), each fetched as the loop reaches it:
  //   for (const auto& batch : loop.micro_batches()) loop.backward(... batch.input_ids ...);
  auto micro_batches() { return MicroBatches{*this}; }

  // Runs `work` as the phase `phase` and returns its value (PhaseTimers::timed).
  template <class Work>
  decltype(auto) timed(std::string phase, Work&& work) {
    return timers_.timed(std::move(phase), std::forward<Work>(work));
  }

  // The "backward" phase of a micro-batch's loss, divided by the step's micro-batches (as
  // DeepSpeed's engine.backward scales it), so that the gradients and the step's loss, summed
  // over them without waiting for the device, are the global batch's mean.
  void backward(const torch::Tensor& loss) {
    const auto scaled = loss / static_cast<double>(micro_batches_);
    timers_.timed("backward", [&] { scaled.backward(); });
    step_loss_ += scaled.detach().to(torch::kDouble);
  }

  // A micro-batch's forward (the "forward" phase) and backward (the "backward" phase), where
  // loss_of(rows) is the mean loss of some of input_ids' rows: backward(timed("forward", ...)) on
  // the whole micro-batch, or, on a CPU under --cpu-batch-split (by default 2 parts with 2 or more
  // intra-op threads), its rows split into parts, each part's forward and backward on a thread of
  // its own (train/core_workers.hpp), each part's loss weighted by its share of the rows (every row
  // has as many targets: the packed blocks' S - 1).
  template <class LossOf>
  void forward_backward(const torch::Tensor& input_ids, LossOf&& loss_of) {
    const auto parts = batch_split_parts(input_ids.size(0));
    if (parts <= 1) {
      backward(timed("forward", [&] { return loss_of(input_ids); }));
      return;
    }
    const auto rows = input_ids.tensor_split(parts, 0);
    const double all_rows = static_cast<double>(input_ids.size(0) * micro_batches_);
    std::vector<torch::Tensor> losses(rows.size());
    timed("forward", [&] {
      core_workers_->run(
          [&](int part) {
            const auto& mine = rows[static_cast<std::size_t>(part)];
            losses[static_cast<std::size_t>(part)] = loss_of(mine) * (static_cast<double>(mine.size(0)) / all_rows);
          },
          "forward");
    });
    timed("backward", [&] {
      core_workers_->run([&](int part) { losses[static_cast<std::size_t>(part)].backward(); }, "backward");
    });
    for (const auto& loss : losses) step_loss_ += loss.detach().to(torch::kDouble);
  }

  // The loss of a micro-batch whose forward and backward ran elsewhere (a pipeline's step, which
  // runs both for each of its own micro-batches): counted in the step's loss as backward() counts it.
  void add_loss(const torch::Tensor& loss) {
    step_loss_ += loss.detach().to(torch::kDouble) / static_cast<double>(micro_batches_);
  }

  // The update step: clipping (--max-grad-norm), the scheduled rate, the optimizer's step, and
  // the gradients freed (or, without `set_to_none`, zeroed in place).
  void update(TrainState& state, bool set_to_none = true) {
    if (args_.max_grad_norm > 0) state.grad_norm = clip(args_.max_grad_norm);
    optimizer_.set_lr(lr(state));
    optimizer_.step();
    optimizer_.zero_grad(set_to_none);
  }

  // The step is done: its loss (the mean over the global batch), a metrics line every
  // --log-freq steps, a checkpoint every --ckpt-freq steps and at the run's last step.
  void end_step(TrainState& state) {
    micro_batch_ = 0;
    experiment_.end_step(state, global_mean(std::exchange(step_loss_, zero_loss())).template item<double>(),
                         epochs_.progress());
    if (state.global_step % args_.log_freq == 0)
      experiment_.log_metrics(state, epochs_.steps_per_epoch(), lr(state), timers_);
    if (args_.eval_freq > 0 && state.global_step % args_.eval_freq == 0) evaluate(state);
    if (experiment_.checkpoint_due(state, epochs_.steps_per_epoch())) experiment_.save(state, model_, optimizer_);
    profiler_.end_step();
  }

  // --eval-freq: the loss on the held-out blocks (train/evaluation.hpp), each data-parallel rank
  // a share and every rank of the model in each forward, logged by the experiment. Every rank
  // calls it.
  void evaluate(const TrainState& state) {
    experiment_.log_evaluation(state,
                               evaluate_held_out(
                                   *held_out_, args_.batch_size, data_parallel_size_, data_parallel_rank_, device_,
                                   [&](const torch::Tensor& input_ids) { return forward_loss(input_ids); },
                                   [&](torch::Tensor sum) { return global_mean(std::move(sum)); }));
  }

  // The scheduled rate of the step `state` is at.
  double lr(const TrainState& state) const { return schedule_.lr_at(state.global_step); }
  PhaseTimers& timers() { return timers_; }
  const Logger& log() const { return experiment_.log(); }

 private:
  // The range micro_batches() returns: an input range whose elements are made as they are read.
  struct MicroBatches {
    Loop& loop;
    struct End {};
    struct Iterator {
      Loop* loop;
      std::int64_t index;
      MicroBatch operator*() const { return MicroBatch(*loop, index + 1 == loop->micro_batches_); }
      Iterator& operator++() {
        ++index;
        return *this;
      }
      bool operator==(End) const { return index == loop->micro_batches_; }
    };
    Iterator begin() const { return {&loop, 0}; }
    End end() const { return {}; }
  };

  torch::Tensor zero_loss() const {
    return torch::zeros({}, torch::TensorOptions().device(device_).dtype(torch::kDouble));
  }
  torch::Tensor global_mean(torch::Tensor loss) const {
    if constexpr (requires { model_.mean_over_data_parallel(loss); })
      return model_.mean_over_data_parallel(std::move(loss));
    else
      return loss;
  }
  // A forward alone and its loss (the constructor refused --eval-freq for a model without one).
  torch::Tensor forward_loss(const torch::Tensor& input_ids) {
    if constexpr (requires { model_->loss(input_ids, input_ids); })
      return model_->loss(input_ids, /*labels=*/input_ids);
    else if constexpr (requires { model_.loss(input_ids, input_ids); })
      return model_.loss(input_ids, /*labels=*/input_ids);
    else
      throw ConfigError("--eval-freq: this model has no forward-only pass");
  }
  // The parts forward_backward splits a micro-batch of `rows` into (1: not split).
  int batch_split_parts(std::int64_t rows) const {
    const int parts = core_workers_ ? core_workers_->parts() : 1;
    return rows >= parts ? parts : 1;
  }
  // --cpu-batch-split, resolved as the run starts: its workers, when it splits.
  void start_core_workers() {
    if constexpr (single_process_model) {
      const int threads = at::get_num_threads();
      const int parts = cpu_batch_split_parts(args_.cpu_batch_split, {.device = device_,
                                                                      .intra_op_threads = threads,
                                                                      .rows = args_.batch_size,
                                                                      .grad_accum = micro_batches_,
                                                                      .deterministic = args_.deterministic});
      if (parts <= 1) return;
      core_workers_.emplace(parts, std::max(1, threads / parts));
      experiment_.log().info(fmt::format(
          "--cpu-batch-split {}: each micro-batch in {} parts, each on a thread of its own with {} intra-op thread(s)",
          args_.cpu_batch_split, parts, core_workers_->threads_per_part()));
    } else if (args_.cpu_batch_split != "auto" && args_.cpu_batch_split != "off") {
      throw ConfigError(fmt::format(
          "--cpu-batch-split {}: only chapter 1's model, in one process, splits its batch across threads; a parallel "
          "model's ranks each run theirs whole (use --threads for each rank's intra-op threads)",
          args_.cpu_batch_split));
    }
  }
  double clip(double max_norm) {
    if constexpr (requires { model_.clip_grad_norm(max_norm); })
      return model_.clip_grad_norm(max_norm);
    else
      return train::clip_grad_norm(model_->parameters(), max_norm);
  }

  const TrainArgs& args_;
  Model& model_;
  Optimizer& optimizer_;
  std::int64_t micro_batches_;  // of a step
  torch::Device device_;
  LrSchedule schedule_;
  Experiment experiment_;
  PhaseTimers timers_;
  torch::Tensor step_loss_;       // the step's loss so far, summed over its micro-batches
  std::int64_t micro_batch_ = 0;  // of the step under way
  Epochs epochs_;
  StepProfiler profiler_;              // after experiment_, whose logger it writes to
  const data::TokenBlocks* held_out_;  // --eval-split's blocks, or nullptr
  std::int64_t data_parallel_size_, data_parallel_rank_;
  std::optional<CoreWorkers> core_workers_;  // --cpu-batch-split's threads, when it splits
};

}  // namespace meshtorch::train
