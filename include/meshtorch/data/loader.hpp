#pragma once
// A background loader: one worker thread gathers the next micro-batches while the model
// trains (the guide's num_workers=1, prefetch_factor=2), so data time is a queue pop.
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include <meshtorch/torch.hpp>

#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/sampler.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

struct MicroBatch {
  std::int64_t step = 0;    // within the epoch
  std::int64_t micro = 0;   // 0..grad_accum-1
  torch::Tensor input_ids;  // [batch, seq] int64, pinned when feeding a GPU
};

class PrefetchingLoader {
 public:
  // Yields micro-batches of `epoch` from step `first_step` to the end of the epoch.
  MESHTORCH_DECL PrefetchingLoader(const TokenBlocks& blocks, const DpInvariantSampler& sampler, std::int64_t epoch,
                                   std::int64_t first_step, bool pin_memory, std::size_t prefetch = 2);
  PrefetchingLoader(const PrefetchingLoader&) = delete;
  PrefetchingLoader& operator=(const PrefetchingLoader&) = delete;

  MESHTORCH_DECL ~PrefetchingLoader();

  // The next micro-batch, or nothing at the end of the epoch. Rethrows the worker's error.
  std::optional<MicroBatch> next() {
    std::unique_lock lock(mutex_);
    ready_.wait(lock, [this] { return !queue_.empty() || finished_; });
    if (!queue_.empty()) {
      auto batch = std::move(queue_.front());
      queue_.pop_front();
      space_.notify_all();
      return batch;
    }
    if (error_) std::rethrow_exception(error_);
    return std::nullopt;
  }

 private:
  bool push(MicroBatch batch) {
    std::unique_lock lock(mutex_);
    space_.wait(lock, [this] { return queue_.size() < capacity_ || stopping_; });
    if (stopping_) return false;
    queue_.push_back(std::move(batch));
    ready_.notify_all();
    return true;
  }

  std::size_t capacity_;
  std::mutex mutex_;
  std::condition_variable ready_, space_;
  std::deque<MicroBatch> queue_;
  bool finished_ = false, stopping_ = false;
  std::exception_ptr error_;
  std::thread worker_;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(core)
namespace meshtorch::data {

MESHTORCH_DECL PrefetchingLoader::PrefetchingLoader(const TokenBlocks& blocks, const DpInvariantSampler& sampler,
                                                    std::int64_t epoch, std::int64_t first_step, bool pin_memory,
                                                    std::size_t prefetch)
    : capacity_(prefetch) {
  worker_ = std::thread([this, &blocks, &sampler, epoch, first_step, pin_memory] {
    try {
      const auto permutation = sampler.permutation(epoch);
      for (std::int64_t step = first_step; step < sampler.steps_per_epoch(); ++step) {
        for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
          auto ids = blocks.gather(sampler.indices(permutation, step, micro));
          if (pin_memory) ids = ids.pin_memory();
          if (!push(MicroBatch{step, micro, std::move(ids)})) return;
        }
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    finished_ = true;
    ready_.notify_all();
  });
}

MESHTORCH_DECL PrefetchingLoader::~PrefetchingLoader() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    space_.notify_all();
  }
  worker_.join();
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(core)
