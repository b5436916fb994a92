#pragma once
// Wall-clock timers per training phase (data, forward, backward, update). On a GPU the device
// is synchronised at each phase boundary, as the guide's timers do, so a phase's time is its
// own and not that of kernels queued before it. While a profiler records (--profile,
// train/profiler.hpp), each phase is also a user scope of its trace, as torch.profiler's
// record_function("forward") is, so that every op can be counted in its phase.
#include <chrono>
#include <map>
#include <string>
#include <utility>

#include <meshtorch/torch.hpp>

namespace meshtorch::train {

class PhaseTimers {
 public:
  explicit PhaseTimers(torch::Device device) : device_(device) {}

  class Scope {
   public:
    Scope(PhaseTimers& timers, std::string phase) : timers_(timers), phase_(std::move(phase)) {
      // Without a profiler the scope is inactive: a check of the thread's callbacks, no more.
      if (record_.isActive()) record_.before(phase_, c10::ArrayRef<const c10::IValue>{});
      timers_.synchronize();
      start_ = std::chrono::steady_clock::now();
    }
    ~Scope() {
      timers_.synchronize();
      timers_.totals_[phase_] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    PhaseTimers& timers_;
    std::string phase_;
    std::chrono::steady_clock::time_point start_;
    at::RecordFunction record_{at::RecordScope::USER_SCOPE};  // ends before phase_, which names it
  };

  Scope time(std::string phase) { return Scope(*this, std::move(phase)); }

  // Runs `work` as this phase and returns what it returns, so that a timed value needs no
  // declaration before its block: `auto loss = timers.timed("forward", [&] { return ...; });`.
  template <class Work>
  decltype(auto) timed(std::string phase, Work&& work) {
    Scope scope(*this, std::move(phase));
    return std::forward<Work>(work)();
  }

  // Seconds per phase since the last reset.
  const std::map<std::string, double>& totals() const { return totals_; }
  void reset() { totals_.clear(); }

 private:
  void synchronize() const {
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index() < 0 ? -1 : device_.index());
  }

  torch::Device device_;
  std::map<std::string, double> totals_;
};

}  // namespace meshtorch::train
