#pragma once
// Epoch after epoch of the training data from where a run stands, as the guide's loop goes over
// them: each epoch's prefetching loader (from the step the run resumed at) and progress bar, and
// the finished check (after the last epoch, or at --max-steps).
//
//   mt::train::Epochs epochs(args, blocks, sampler, rank, device);
//   for (auto state = ...resume...; epochs.next_step(state);) { ... epochs.next_batch() ... }
//
// train::Loop goes over its steps with one; chapter 8's loop, over the engine's micro-batches.
#include <cstdint>
#include <optional>

#include <meshtorch/torch.hpp>

#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/loader.hpp>
#include <meshtorch/data/sampler.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/state.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch::train {

class Epochs {
 public:
  // The progress bar is drawn by rank 0 only.
  Epochs(const TrainArgs& args, const data::TokenBlocks& blocks, const data::DpInvariantSampler& sampler, int rank,
         torch::Device device)
      : blocks_(blocks),
        sampler_(sampler),
        num_epochs_(args.num_epochs),
        max_steps_(args.max_steps),
        rank_(rank),
        device_(device) {}

  Epochs(const Epochs&) = delete;
  Epochs& operator=(const Epochs&) = delete;

  // Whether the run goes on: false after the last epoch and at --max-steps. At an epoch's end it
  // moves `state` to the next epoch, with a new loader and progress bar.
  bool next_step(TrainState& state) {
    for (; state.epoch < num_epochs_; ++state.epoch, state.epoch_step = 0) {
      if (!loader_) {
        loader_.emplace(blocks_, sampler_, state.epoch, state.epoch_step, device_.is_cuda());
        progress_.emplace(sampler_.steps_per_epoch(), /*enabled=*/rank_ == 0);
      }
      if (state.epoch_step < sampler_.steps_per_epoch()) return !max_steps_reached(state, max_steps_);
      progress_.reset();
      loader_.reset();
    }
    return false;
  }

  // This rank's next micro-batch of the epoch, on the device.
  torch::Tensor next_batch() { return loader_->next()->input_ids.to(device_, /*non_blocking=*/true); }

  ProgressBar& progress() { return *progress_; }
  std::int64_t steps_per_epoch() const { return sampler_.steps_per_epoch(); }

 private:
  const data::TokenBlocks& blocks_;
  const data::DpInvariantSampler& sampler_;
  std::int64_t num_epochs_, max_steps_;
  int rank_;
  torch::Device device_;
  std::optional<data::PrefetchingLoader> loader_;
  std::optional<ProgressBar> progress_;  // after the loader: its closing line comes before the next epoch's
};

}  // namespace meshtorch::train
