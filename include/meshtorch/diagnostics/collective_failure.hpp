#pragma once
// Where a failed collective is reported. Work::wait and DDP's bucket hook call
// report_collective_failure; the watchdog (diagnostics/watchdog.hpp), armed by launch(), installs
// itself as the handler: it names the culprit, dumps the flight recorder and ends the process.
// Kept apart from the watchdog so that code which only issues collectives compiles neither the
// watchdog nor its hang analysis and JSON (docs/performance.md "Compile time"): only the
// translation unit that calls comm::init does.
#include <atomic>
#include <cstdint>
#include <string>

#include <meshtorch/diagnostics/flight_recorder.hpp>

namespace meshtorch::diagnostics {

// `record` is the flight recorder's id of the collective, `collective` what it was and over
// which group, `what` the backend's message. Returns if the process is to go on (the caller
// throws); does not return if the handler ends the process.
using CollectiveFailureHandler = void (*)(std::uint64_t record, const std::string& collective, const std::string& what);

namespace detail {
inline std::atomic<CollectiveFailureHandler> collective_failure_handler{nullptr};
}  // namespace detail

inline void set_collective_failure_handler(CollectiveFailureHandler handler) {
  detail::collective_failure_handler.store(handler);
}

inline void report_collective_failure(std::uint64_t record, const std::string& collective, const std::string& what) {
  if (const auto handler = detail::collective_failure_handler.load()) {
    handler(record, collective, what);
    return;
  }
  FlightRecorder::instance().failed(record);  // no watchdog in this process
}

}  // namespace meshtorch::diagnostics
