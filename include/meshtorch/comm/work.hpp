#pragma once
// Work<Result>: a collective in flight. wait() finishes the result (divides an average,
// concatenates gathered pieces) and returns it; a failure or timeout becomes a CommError naming
// the collective, the group and the rank.
//
// On the CPU (shared memory or Gloo) wait() blocks the host up to the group's timeout. On NCCL it orders the current
// CUDA stream after the collective and returns at once, as torch's work.wait() does: an explicit
// timeout there would make ProcessGroupNCCL block the host until the collective ends, making TP
// and FSDP host-synchronous. NCCL's limit is the process group's own timeout, enforced by its
// watchdog.
//
// Every collective issued through detail::issue and waited through Work::wait is recorded in the
// flight recorder (diagnostics/flight_recorder.hpp); a failed wait is reported (diagnostics/collective_failure.hpp)
// to the watchdog, which, once armed by launch(), names the rank that stalled and ends the
// process (diagnostics/watchdog.hpp).
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/diagnostics/flight_recorder.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

namespace detail {

MESHTORCH_DECL CommError collective_error(std::string_view collective, const AxisGroup& group, std::string_view why);

// The flight recorder's id of the collective this thread issued last; the Work made from it
// takes it over.
inline thread_local std::uint64_t last_recorded = 0;

// What a record numbers: the group's collectives, or its point-to-point messages (sends and
// receives), numbered apart because each rank sends and receives its own count of them (a
// pipeline's first and last stages differ), while every member issues the same collectives.
enum class Traffic { collective, message };

MESHTORCH_DECL std::uint64_t record_collective(std::string_view collective, const AxisGroup& group,
                                               const at::Tensor& tensor, Traffic traffic = Traffic::collective);

// Issues a c10d call, turning its synchronous errors into CommErrors, and records it (with the
// shape and dtype of `tensor`, when given) in the flight recorder.
template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(std::string_view collective, const AxisGroup& group, const at::Tensor& tensor,
                                     Issue&& call, Traffic traffic = Traffic::collective) {
  // Recorded before it is issued: an issue that blocks (a communicator set up lazily) shows.
  const std::uint64_t record = record_collective(collective, group, tensor, traffic);
  try {
    auto work = std::forward<Issue>(call)();
    last_recorded = record;
    return work;
  } catch (const std::exception& e) {
    diagnostics::FlightRecorder::instance().failed(record);
    throw collective_error(collective, group, e.what());
  }
}

template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(std::string_view collective, const AxisGroup& group, Issue&& call) {
  return issue(collective, group, at::Tensor(), std::forward<Issue>(call));
}

// The part of Work::wait that does not depend on the result type, so that it is compiled once:
// waits for `work` (up to the group's timeout on Gloo) and records the wait in the flight
// recorder; a failure or timeout is reported and thrown as a CommError.
MESHTORCH_DECL void wait_collective(c10d::Work& work, std::uint64_t record, const std::string& collective,
                                    const AxisGroup& group);

// The collective `record` has been waited for. On the CPU it has ended. On a GPU the wait only
// ordered the current stream after it, so it ends in the flight recorder when an event recorded
// on that stream now has passed (polled by the watchdog), not before.
MESHTORCH_DECL void record_completion(std::uint64_t record, const AxisGroup& group);

}  // namespace detail

template <class Result>
class Work {
 public:
  Work(c10::intrusive_ptr<c10d::Work> work, std::function<Result()> finish, std::string collective, AxisGroup group)
      : work_(std::move(work)),
        record_(work_ ? std::exchange(detail::last_recorded, 0) : 0),
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
    if (work_) detail::wait_collective(*work_, record_, collective_, group_);
    result_ = finish_();
    return *result_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::uint64_t record_ = 0;  // in the flight recorder
  std::function<Result()> finish_;
  std::string collective_;
  AxisGroup group_;
  std::optional<Result> result_;
};

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>

#include <meshtorch/diagnostics/collective_failure.hpp>

namespace meshtorch::comm::detail {

MESHTORCH_DECL CommError collective_error(std::string_view collective, const AxisGroup& group, std::string_view why) {
  return CommError(fmt::format("{} over the {} failed: {}", collective, group.describe(), why));
}

MESHTORCH_DECL std::uint64_t record_collective(std::string_view collective, const AxisGroup& group,
                                               const at::Tensor& tensor, Traffic traffic) {
  auto& recorder = diagnostics::FlightRecorder::instance();
  if (!recorder.enabled() || !group.backend()) return 0;
  std::string backend_name;
  try {
    backend_name = group.backend()->getBackendName();
  } catch (const std::exception&) {
  }
  // The recorder numbers per key: a group's messages get a key of their own beside its collectives'.
  const void* key = group.backend().get();
  if (traffic == Traffic::message) key = static_cast<const char*>(key) + 1;
  const std::string axis = traffic == Traffic::message ? group.axis_name() + " send/recv" : group.axis_name();
  return recorder.record(key, axis, group.ranks(), backend_name, collective,
                         tensor.defined() ? std::span<const std::int64_t>(tensor.sizes().data(), tensor.sizes().size())
                                          : std::span<const std::int64_t>(),
                         tensor.defined() ? c10::toString(tensor.scalar_type()) : "");
}

MESHTORCH_DECL void wait_collective(c10d::Work& work, std::uint64_t record, const std::string& collective,
                                    const AxisGroup& group) {
  diagnostics::FlightRecorder::instance().waiting(record);
  try {
    // A CPU backend's wait throws once the timeout passes without completion.
    if (group.device() == Device::cpu)
      work.wait(group.timeout());
    else
      work.wait();
  } catch (const std::exception& e) {
    diagnostics::report_collective_failure(record, collective + " over the " + group.describe(), e.what());
    throw collective_error(collective, group, fmt::format("{} (timeout {} ms)", e.what(), group.timeout().count()));
  }
  record_completion(record, group);
}

// A CUDA event of `device` from a pool that never destroys them: destroying an event can block
// while a kernel on the device hangs, which is when the watchdog thread that asks them must not.
// The last owner's release only puts it back. Never freed: the pool outlives the CUDA runtime.
MESHTORCH_DECL std::shared_ptr<c10::Event> pooled_device_event(c10::Device device) {
  struct Pool {
    std::mutex mutex;
    std::map<c10::DeviceIndex, std::vector<c10::Event*>> free;
  };
  static auto* pool = new Pool;
  c10::Event* event = nullptr;
  {
    std::lock_guard lock(pool->mutex);
    if (auto& free = pool->free[device.index()]; !free.empty()) {
      event = free.back();
      free.pop_back();
    }
  }
  if (!event) event = new c10::Event(device.type());
  return std::shared_ptr<c10::Event>(event, [index = device.index()](c10::Event* returned) {
    std::lock_guard lock(pool->mutex);
    pool->free[index].push_back(returned);
  });
}

MESHTORCH_DECL void record_completion(std::uint64_t record, const AxisGroup& group) {
  if (!record) return;
  auto& recorder = diagnostics::FlightRecorder::instance();
  // On the CPU the wait ended it. A GPU group bound to no device cannot say which stream waited.
  if (group.device() == Device::cpu || group.cuda_device() < 0) {
    recorder.completed(record);
    return;
  }
  try {
    // c10's device-generic event and guard, so that this compiles without the CUDA headers.
    const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(group.cuda_device()));
    auto event = pooled_device_event(device);
    event->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
    recorder.completes_when(record, [event, device] {
      // The asking thread (the watchdog's) makes the rank's GPU its current device, and keeps
      // it: a CUDA call there with GPU 0 current would open a context on GPU 0 for every rank.
      const c10::impl::VirtualGuardImpl guard(device.type());
      if (guard.getDevice() != device) guard.setDevice(device);
      return event->query();
    });
  } catch (const std::exception&) {
    recorder.completed(record);  // no event to ask: ended at its wait, as the CPU's
  }
}

}  // namespace meshtorch::comm::detail
#endif  // MESHTORCH_DEFINES(core)
