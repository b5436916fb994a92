#pragma once
// Work<Result>: a collective in flight. wait() finishes the result (divides an average,
// concatenates gathered pieces) and returns it; a failure or timeout becomes a CommError naming
// the collective, the group and the rank.
//
// On Gloo (CPU) wait() blocks the host up to the group's timeout. On NCCL it orders the current
// CUDA stream after the collective and returns at once, as torch's work.wait() does: an explicit
// timeout there would make ProcessGroupNCCL block the host until the collective ends, making TP
// and FSDP host-synchronous. NCCL's limit is the process group's own timeout, enforced by its
// watchdog.
#include <chrono>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/error.hpp>

namespace meshtorch::comm {

namespace detail {

inline CommError collective_error(std::string_view collective, const AxisGroup& group,
                                  std::string_view why) {
  return CommError(fmt::format("{} over the {} failed: {}", collective, group.describe(), why));
}

// Issues a c10d call, turning its synchronous errors into CommErrors.
template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(std::string_view collective, const AxisGroup& group,
                                     Issue&& call) {
  try {
    return std::forward<Issue>(call)();
  } catch (const std::exception& e) {
    throw collective_error(collective, group, e.what());
  }
}

}  // namespace detail

template <class Result>
class Work {
 public:
  Work(c10::intrusive_ptr<c10d::Work> work, std::function<Result()> finish,
       std::string collective, AxisGroup group)
      : work_(std::move(work)),
        finish_(std::move(finish)),
        collective_(std::move(collective)),
        group_(std::move(group)) {}

  // A result that needed no communication (a group of one rank).
  static Work ready(Result result) {
    Work work(nullptr, nullptr, "", AxisGroup{});
    work.result_ = std::move(result);
    return work;
  }

  bool is_completed() const { return result_.has_value() || !work_ || work_->isCompleted(); }

  Result wait() {
    if (result_) return *result_;
    if (work_) {
      try {
        // Gloo's wait throws once the timeout passes without completion.
        if (group_.device() == Device::cpu)
          work_->wait(group_.timeout());
        else
          work_->wait();
      } catch (const std::exception& e) {
        throw detail::collective_error(
            collective_, group_,
            fmt::format("{} (timeout {} ms)", e.what(), group_.timeout().count()));
      }
    }
    result_ = finish_();
    return *result_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<Result()> finish_;
  std::string collective_;
  AxisGroup group_;
  std::optional<Result> result_;
};

}  // namespace meshtorch::comm
