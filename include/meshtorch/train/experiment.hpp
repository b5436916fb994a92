#pragma once
// The experiment around a training loop, as the guide's scripts keep it: the folder
// <save-dir>/<experiment-name>, resuming from its checkpoint, a metrics line every --log-freq
// steps (printed by rank 0 and appended to metrics.jsonl) and a checkpoint every --ckpt-freq
// steps and at the run's last step. train::Loop (train/loop.hpp) and chapter 8's engine call
// these functions for a chapter:
//
//   mt::train::Experiment experiment(args, rank, sampler.global_batch(), device);
//   auto state = experiment.resume(model, optimizer);                 // or a fresh state
//   ...
//       experiment.end_step(state, loss, progress);                   // after optimizer.step()
//       if (state.global_step % args.log_freq == 0) experiment.log_metrics(state, steps_per_epoch, lr, timers);
//       if (experiment.checkpoint_due(state, steps_per_epoch)) experiment.save(state, model, optimizer);
//
// How a model is saved and loaded is the model type's business: Checkpointing<Model> says
// (parallel/checkpointing.hpp, for chapter 1's model and for every model parallelize() builds).
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/checkpoint.hpp>
#include <meshtorch/train/evaluation.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/metrics.hpp>
#include <meshtorch/train/state.hpp>
#include <meshtorch/train/timers.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch::train {

// Saving and resuming one kind of model with its optimizer. Specialisations provide
//   static void save(const std::filesystem::path& exp_dir, Model&, const Optimizer&, const TrainState&,
//                    const RunIdentity&, int keep_checkpoints);
//   static std::optional<TrainState> load(const std::filesystem::path& exp_dir, Model&, Optimizer&,
//                                         const RunIdentity&);
template <class Model>
struct Checkpointing {
  static_assert(sizeof(Model) == 0,
                "Checkpointing<Model>: no checkpoint path is visible for this model type; include "
                "<meshtorch/parallel/checkpointing.hpp> (chapter 1's model and every model parallelize() builds)");
};

// The flags a resumed run must share with the run that saved it.
MESHTORCH_DECL RunIdentity run_identity(const TrainArgs& args, std::int64_t global_batch);

class Experiment {
 public:
  // `global_batch`: samples per optimizer step over all data-parallel ranks and micro-batches;
  // tokens_per_s counts them all. `tracker`: where this rank's metrics go besides metrics.jsonl
  // (train::tensorboard_tracker(args, rank) for --tensorboard), or nullptr.
  MESHTORCH_DECL Experiment(const TrainArgs& args, int rank, std::int64_t global_batch, torch::Device device,
                            std::unique_ptr<MetricsTracker> tracker = nullptr);

  const Logger& log() const { return log_; }
  bool enabled() const { return dir_.has_value(); }
  // <save-dir>/<experiment-name>; only when -e was given.
  const std::filesystem::path& dir() const { return dir_.value(); }

  // The state saved in the checkpoint the run starts from, with the model and optimizer restored:
  // --resume-from's (which must hold one), else the experiment's latest; a fresh state when there
  // is none, with --no-resume, or without -e.
  template <class Model, class Optimizer>
  TrainState resume(Model& model, Optimizer& optimizer) {
    TrainState state = start_state(model, optimizer);
    if (metrics_)
      if (const auto later = metrics_->set_aside_after(state.global_step))
        log_.warning(fmt::format(
            "{}: {} line(s) after global_step {} came from a run that stopped before its next "
            "checkpoint; moved to {}",
            (*dir_ / MetricsFile::file_name).string(), later, state.global_step, MetricsFile::discarded_name));
    if (tracker_) tracker_->on_start(state.global_step);
    return state;
  }

 private:
  template <class Model, class Optimizer>
  TrainState start_state(Model& model, Optimizer& optimizer) {
    if (resume_from_) {
      auto resumed = Checkpointing<Model>::load(*resume_from_, model, optimizer, identity_);
      if (!resumed)
        throw DataError(
            fmt::format("--resume-from {}: no checkpoint there (expected a ckpt-<step> folder with its "
                        "manifest, or an experiment folder whose '{}' link names one)",
                        resume_from_->string(), checkpoint_link_name));
      log_.info(fmt::format("resumed from {} at global_step {}", resume_from_->string(), resumed->global_step));
      return *resumed;
    }
    if (!dir_) return {};
    if (no_resume_) {
      if (rank_ == 0 && std::filesystem::exists(std::filesystem::symlink_status(*dir_ / checkpoint_link_name)))
        log_.warning(
            fmt::format("--no-resume: starting at step 0 although {} names a checkpoint; this run's first "
                        "save replaces it",
                        (*dir_ / checkpoint_link_name).string()));
      return {};
    }
    auto resumed = Checkpointing<Model>::load(*dir_, model, optimizer, identity_);
    if (!resumed) return {};
    log_.info(fmt::format("resumed from {} at global_step {}", (*dir_ / checkpoint_link_name).string(),
                          resumed->global_step));
    return *resumed;
  }

 public:
  // One optimizer step is done; `loss` is its mean over the whole global batch. A non-finite loss
  // stops the run here, before anything of it is logged or saved (every rank sees the same mean).
  MESHTORCH_DECL void end_step(TrainState& state, double loss, ProgressBar& progress) const;

  // The guide's metrics since the last line: printed and appended by rank 0 (every rank must
  // call it, since closing the window resets each rank's timers and peak memory).
  MESHTORCH_DECL void log_metrics(TrainState& state, std::int64_t steps_per_epoch, double lr, PhaseTimers& timers);

  // An evaluation of the held-out blocks after `state`'s step (train/evaluation.hpp), its loss
  // already averaged over the data-parallel ranks: printed and appended to metrics.jsonl by rank
  // 0 as eval_loss, eval_perplexity, eval_tokens and eval_s, and given to the tracker. Its time is
  // not training time.
  MESHTORCH_DECL void log_evaluation(const TrainState& state, const Evaluation& evaluation);

  // Whether the step just ended saves a checkpoint: every --ckpt-freq steps and at the run's
  // last step (--max-steps reached, or the last step of the last epoch), so a run with -e always
  // ends with its final state saved.
  bool checkpoint_due(const TrainState& state, std::int64_t steps_per_epoch) const {
    if (!dir_) return false;
    const bool last_step = (max_steps_ > 0 && state.global_step >= max_steps_) ||
                           (state.epoch + 1 >= num_epochs_ && state.epoch_step >= steps_per_epoch);
    return state.global_step % ckpt_freq_ == 0 || last_step;
  }

  // A checkpoint of the model, optimizer, RNG and state (a collective for parallel models:
  // every rank calls it). Without -e nothing is saved. The save's time is not training time.
  template <class Model, class Optimizer>
  void save(const TrainState& state, Model& model, const Optimizer& optimizer) {
    if (!dir_) return;
    const auto start = std::chrono::steady_clock::now();
    Checkpointing<Model>::save(*dir_, model, optimizer, state, identity_, keep_checkpoints_);
    log_.info(fmt::format("saved checkpoint at global_step {}", state.global_step));
    window_.exclude(std::chrono::steady_clock::now() - start);
  }

 private:
  // A metrics record: printed and appended to metrics.jsonl by rank 0, given to the tracker on every rank.
  MESHTORCH_DECL void publish(const nlohmann::ordered_json& record);

  Logger log_;
  int rank_;
  RunIdentity identity_;
  std::int64_t ckpt_freq_, max_steps_, num_epochs_;
  int keep_checkpoints_;
  bool no_resume_;
  std::optional<std::filesystem::path> resume_from_;
  std::optional<std::filesystem::path> dir_;
  std::optional<MetricsFile> metrics_;
  LogWindow window_;
  std::unique_ptr<MetricsTracker> tracker_;
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include <meshtorch/models/llama/config_json.hpp>

namespace meshtorch::train {

MESHTORCH_DECL RunIdentity run_identity(const TrainArgs& args, std::int64_t global_batch) {
  auto dataset = args.dataset_subset.empty() ? args.dataset_name
                                             : fmt::format("{} (subset {})", args.dataset_name, args.dataset_subset);
  // Holding blocks out changes the blocks the sampler orders: a resume must hold out the same.
  if (args.eval_split > 0) dataset += fmt::format(" (--eval-split {})", args.eval_split);
  return {args.seed, args.seq_length, global_batch, dataset, args.model_name};
}

namespace experiment_detail {

// The tokens of one optimizer step, for tokens_per_s: a global batch from a DeepSpeed config may
// be up to 2^63 - 1 before any sampler has compared it with the data set.
inline std::int64_t tokens_per_step(std::int64_t global_batch, std::int64_t seq_length) {
  std::int64_t tokens = 0;
  if (__builtin_mul_overflow(global_batch, seq_length, &tokens))
    throw ConfigError(
        fmt::format("a global batch of {} sequences x -s/--seq-length {} overflows a 64-bit integer "
                    "(at most {} tokens per step)",
                    global_batch, seq_length, std::numeric_limits<std::int64_t>::max()));
  return tokens;
}

}  // namespace experiment_detail

MESHTORCH_DECL Experiment::Experiment(const TrainArgs& args, int rank, std::int64_t global_batch, torch::Device device,
                                      std::unique_ptr<MetricsTracker> tracker)
    : log_(rank),
      rank_(rank),
      identity_(run_identity(args, global_batch)),
      ckpt_freq_(args.ckpt_freq),
      max_steps_(args.max_steps),
      num_epochs_(args.num_epochs),
      keep_checkpoints_(args.keep_checkpoints),
      no_resume_(args.no_resume),
      window_(device, /*tokens_per_step=*/experiment_detail::tokens_per_step(global_batch, args.seq_length)),
      tracker_(std::move(tracker)) {
  // A program that builds its Experiment without a tracker would ignore the flag: say so.
  if (args.tensorboard && !tracker_)
    throw ConfigError(
        "--tensorboard: this program builds its Experiment without a tracker; pass "
        "train::tensorboard_tracker(args, rank) (train/tensorboard.hpp, link meshtorch::tracking)");
  // Said once per job: what -m's config.json holds that the run does not read.
  if (rank_ == 0)
    if (const auto note = llama::unread_config_fields_note(args.model_name); !note.empty()) log_.info(note);
  if (!args.resume_from.empty()) resume_from_ = args.resume_from;
  if (!args.experiment_name.empty()) {
    dir_ = std::filesystem::path(args.save_dir) / args.experiment_name;
    // Every rank may create it: create_directories is a no-op when the folder exists.
    std::filesystem::create_directories(*dir_);
    if (rank_ == 0) metrics_ = MetricsFile(*dir_ / MetricsFile::file_name);
  }
}

MESHTORCH_DECL void Experiment::end_step(TrainState& state, double loss, ProgressBar& progress) const {
  if (!std::isfinite(loss))
    throw DataError(
        fmt::format("the loss of global_step {} is {}: stopping before it is logged or saved{}", state.global_step + 1,
                    std::isnan(loss) ? "nan" : fmt::format("{}", loss),
                    dir_ ? fmt::format(" ({} keeps the checkpoints of earlier steps)", dir_->string()) : ""));
  ++state.global_step;
  ++state.epoch_step;
  state.running_loss += loss;
  ++state.running_steps;
  progress.update(state.epoch_step, fmt::format("loss={:.6f}", loss));
}

MESHTORCH_DECL void Experiment::log_evaluation(const TrainState& state, const Evaluation& evaluation) {
  window_.exclude(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(evaluation.seconds)));
  publish({{"global_step", state.global_step},
           {"eval_loss", evaluation.loss},
           {"eval_perplexity", evaluation.perplexity()},
           {"eval_tokens", evaluation.tokens},
           {"eval_s", evaluation.seconds}});
}

MESHTORCH_DECL void Experiment::publish(const nlohmann::ordered_json& record) {
  if (rank_ == 0) {
    log_.info(format_metrics(record));
    if (metrics_) metrics_->append(record);
  }
  if (tracker_) tracker_->on_metrics(record);
}

MESHTORCH_DECL void Experiment::log_metrics(TrainState& state, std::int64_t steps_per_epoch, double lr,
                                            PhaseTimers& timers) {
  publish(window_.record(state, steps_per_epoch, lr, timers));
  window_.close(state, timers);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
