#pragma once
// The step profiler of the training loop (--profile DIR): LibTorch's Kineto profiler over
// --profile-steps steps from the run's --profile-from'th step, so that the steps it sees are past
// warm-up (allocation, first touch). train::Loop calls it as steps begin and end; PhaseTimers'
// phases are user scopes in the trace (timers.hpp), so each op is counted in the phase it ran in:
//
//   DIR/trace.json  the Chrome trace (chrome://tracing, Perfetto); trace-rank<R>.json on rank R > 0
//   DIR/ops.json    per phase, per op name, per step: calls, self and total time (ops-rank<R>.json)
//
// An op's self time is its time less that of the ops inside it on the same thread (torch.profiler's
// self_cpu_time_total, computed the same way: intervals nested per thread), so the ops of a phase
// add up to the phase without counting a child twice. Under --cpu-batch-split each part's thread
// opens the phase too: the phase's time is then the union of its scopes (its wall time) and its
// ops' self times are summed over the threads (CPU time), so they may add up to more.
// bench/reference/train_llm_ch1.py writes the same ops.json from torch.profiler, and `bench/run
// --only profile` sets the two side by side. On the CPU autograd's backward runs on the thread
// that calls backward(), inside the "backward" scope; ops outside every phase (the step's loss, a
// checkpoint) are in the phase "other".
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch::train {

// One op name's figures in one phase, per profiled step (calls may be fractional where an op does
// not run every step).
struct OpTimes {
  double calls = 0;
  double self_us = 0;
  double total_us = 0;
};

// A phase's figures per step: its wall time (the sum of its scopes; for "other", of the ops that
// ran outside every phase) and its ops by name.
struct PhaseOps {
  double time_us = 0;
  std::map<std::string, OpTimes> ops;
};

// A recorded CPU interval: an op, or a phase's user scope.
struct ProfiledEvent {
  std::string name;
  std::uint64_t thread = 0;
  std::uint64_t start_ns = 0;
  std::uint64_t end_ns = 0;
  bool is_phase = false;
};

// The phase name of ops that ran outside every phase.
inline constexpr const char* outside_phases = "other";

// Per phase, per op name: each event's self time from the intervals nested in it on its thread,
// its phase from the innermost phase around it; figures divided by `steps`.
MESHTORCH_DECL std::map<std::string, PhaseOps> op_profile(std::vector<ProfiledEvent> events, std::int64_t steps);

class StepProfiler {
 public:
  // Off when args.profile_dir is empty. `rank` names the files of ranks above 0.
  StepProfiler(const TrainArgs& args, int rank, const Logger& log)
      : dir_(args.profile_dir), from_(args.profile_from), steps_(args.profile_steps), rank_(rank), log_(log) {}
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  // A run that ends with the profiler on (an error) leaves the process's profiler off, and writes nothing.
  MESHTORCH_DECL ~StepProfiler();

  // A step begins: the profiler starts at the run's --profile-from'th step.
  void begin_step(std::int64_t global_step) {
    if (!dir_.empty() && ++run_steps_ == from_) start(global_step);
  }
  // A step ended: after --profile-steps steps the profiler stops and writes its files.
  void end_step() {
    if (on_ && ++profiled_ == steps_) stop(/*window_closed=*/true);
  }
  // The run ends: what the profiler recorded so far, if it is still on, is written.
  void end_run() {
    if (on_) stop(/*window_closed=*/false);
  }

 private:
  MESHTORCH_DECL void start(std::int64_t global_step);
  MESHTORCH_DECL void stop(bool window_closed);
  MESHTORCH_DECL void write_profile(bool window_closed);

  std::string dir_;
  std::int64_t from_, steps_;
  int rank_;
  const Logger& log_;
  std::int64_t run_steps_ = 0;  // steps begun in this process
  std::int64_t profiled_ = 0;   // steps ended with the profiler on
  std::int64_t first_global_step_ = 0;
  bool on_ = false;
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <filesystem>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <meshtorch/io/atomic_file.hpp>

namespace meshtorch::train {

MESHTORCH_DECL std::map<std::string, PhaseOps> op_profile(std::vector<ProfiledEvent> events, std::int64_t steps) {
  // Per thread, by start, the longer of two intervals that start together first: then the open
  // intervals on a stack are the ones around the next (torch.profiler's _populate_cpu_children).
  std::sort(events.begin(), events.end(), [](const ProfiledEvent& a, const ProfiledEvent& b) {
    return std::tuple(a.thread, a.start_ns, b.end_ns) < std::tuple(b.thread, b.start_ns, a.end_ns);
  });
  struct Open {
    const ProfiledEvent* event;
    std::uint64_t children_ns;
    const char* phase;  // the innermost phase around it, itself included
  };
  std::map<std::string, PhaseOps> phases;
  // A phase's scopes, on every thread that ran part of it (--cpu-batch-split's workers open the
  // caller's phase too): its wall time is their union, not their sum.
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> phase_scopes;
  const double per_step = 1.0 / static_cast<double>(std::max<std::int64_t>(steps, 1));
  const double per_step_us = 1e-3 * per_step;  // from nanoseconds
  const auto close = [&](const Open& open) {
    const auto& event = *open.event;
    const double duration_us = static_cast<double>(event.end_ns - event.start_ns) * per_step_us;
    auto& phase = phases[open.phase];
    if (event.is_phase) {
      phase_scopes[event.name].emplace_back(event.start_ns, event.end_ns);
      return;
    }
    auto& op = phase.ops[event.name];
    op.calls += per_step;
    op.total_us += duration_us;
    // Children that overlap one another (intervals that only partly intersect) cannot make it negative.
    const auto self_ns = event.end_ns - event.start_ns - std::min(open.children_ns, event.end_ns - event.start_ns);
    op.self_us += static_cast<double>(self_ns) * per_step_us;
  };
  std::vector<Open> stack;
  const auto unwind_to = [&](const ProfiledEvent* next) {
    while (!stack.empty() &&
           (next == nullptr || next->thread != stack.back().event->thread ||
            next->start_ns >= stack.back().event->end_ns || next->end_ns > stack.back().event->end_ns)) {
      close(stack.back());
      stack.pop_back();
    }
  };
  for (const auto& event : events) {
    unwind_to(&event);
    const char* phase = event.is_phase ? event.name.c_str() : stack.empty() ? outside_phases : stack.back().phase;
    if (stack.empty() && !event.is_phase)  // outside every phase: its time is the phase "other"'s
      phases[outside_phases].time_us += static_cast<double>(event.end_ns - event.start_ns) * per_step_us;
    if (!stack.empty()) stack.back().children_ns += event.end_ns - event.start_ns;
    stack.push_back({&event, 0, phase});
  }
  unwind_to(nullptr);
  for (auto& [name, scopes] : phase_scopes) {
    std::sort(scopes.begin(), scopes.end());
    std::uint64_t covered_ns = 0, reached = 0;
    for (const auto& [start, end] : scopes) {
      const auto from = std::max(start, reached);
      if (end > from) covered_ns += end - from;
      reached = std::max(reached, end);
    }
    phases[name].time_us += static_cast<double>(covered_ns) * per_step_us;
  }
  return phases;
}

MESHTORCH_DECL StepProfiler::~StepProfiler() {
  if (!on_) return;
  try {
    torch::autograd::profiler::disableProfiler();
  } catch (...) {  // a destructor during unwinding: the run's own error is the one to report
  }
}

MESHTORCH_DECL void StepProfiler::start(std::int64_t global_step) {
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  const ProfilerConfig config(ProfilerState::KINETO);
  const std::set<ActivityType> activities{ActivityType::CPU};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  on_ = true;
  first_global_step_ = global_step;
  log_.info(fmt::format("profile: recording {} step(s) from global_step {} into {}", steps_, global_step, dir_));
}

MESHTORCH_DECL void StepProfiler::stop(bool window_closed) {
  // Profiling changes no result: a profile that cannot be written (a full disk, a folder this rank
  // may not write) is a warning, never the end of a run whose other ranks would wait for this one.
  try {
    write_profile(window_closed);
  } catch (const std::exception& e) {
    log_.warning(fmt::format("profile: not written ({}); training goes on", e.what()));
  }
}

MESHTORCH_DECL void StepProfiler::write_profile(bool window_closed) {
  on_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  const auto steps = std::max<std::int64_t>(profiled_, 1);
  std::vector<ProfiledEvent> events;
  events.reserve(result->events().size());
  for (const auto& event : result->events()) {
    // Only intervals that start and end on one CPU thread nest (torch.profiler leaves the rest out too).
    if (event.deviceType() != c10::DeviceType::CPU || event.isAsync() || event.endNs() < event.startNs() ||
        event.startThreadId() != event.endThreadId())
      continue;
    events.push_back({event.name(), event.startThreadId(), event.startNs(), event.endNs(),
                      event.scope() == static_cast<std::uint8_t>(at::RecordScope::USER_SCOPE)});
  }
  const auto phases = op_profile(std::move(events), steps);

  const std::filesystem::path dir(dir_);
  std::filesystem::create_directories(dir);
  const auto suffix = rank_ > 0 ? fmt::format("-rank{}", rank_) : std::string();
  const auto trace_path = dir / ("trace" + suffix + ".json");
  result->save(trace_path.string());
  nlohmann::ordered_json phases_json = nlohmann::ordered_json::object();
  for (const auto& [name, phase] : phases) {
    nlohmann::ordered_json ops = nlohmann::ordered_json::object();
    for (const auto& [op, times] : phase.ops)
      ops[op] = {{"calls", times.calls}, {"self_us", times.self_us}, {"total_us", times.total_us}};
    phases_json[name] = {{"time_us", phase.time_us}, {"ops", std::move(ops)}};
  }
  const nlohmann::ordered_json ops_json = {{"stack", "meshtorch"},
                                           {"rank", rank_},
                                           {"first_step", from_},
                                           {"first_global_step", first_global_step_},
                                           {"steps", profiled_},
                                           {"complete", window_closed},
                                           {"per", "step; times in microseconds"},
                                           {"phases", std::move(phases_json)}};
  const auto ops_path = dir / ("ops" + suffix + ".json");
  io::write_file_atomically(ops_path, ops_json.dump(1) + "\n");

  log_.info(fmt::format("profile: {} step(s) from global_step {}{}: {} and {}", profiled_, first_global_step_,
                        window_closed ? "" : fmt::format(" (the run ended before the {} asked for)", steps_),
                        trace_path.string(), ops_path.string()));
  // The ops that cost most, per phase, in the order a step runs them.
  std::vector<std::string> order{"data", "forward", "backward", "update"};
  for (const auto& [name, phase] : phases)
    if (std::find(order.begin(), order.end(), name) == order.end() && name != outside_phases) order.push_back(name);
  order.push_back(outside_phases);
  for (const auto& name : order) {
    const auto found = phases.find(name);
    if (found == phases.end()) continue;
    const auto& phase = found->second;
    std::vector<std::pair<std::string, OpTimes>> ops(phase.ops.begin(), phase.ops.end());
    std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second.self_us > b.second.self_us; });
    double self_us = 0;
    for (const auto& [op, times] : ops) self_us += times.self_us;
    log_.info(fmt::format("profile: {} {:.3f} ms per step, {:.3f} ms of it in ops; top ops by self time:", name,
                          phase.time_us / 1e3, self_us / 1e3));
    for (std::size_t i = 0; i < std::min<std::size_t>(ops.size(), 12); ++i)
      log_.info(fmt::format("profile:   {:<56} {:>7.1f} calls {:>10.3f} ms self {:>10.3f} ms total", ops[i].first,
                            ops[i].second.calls, ops[i].second.self_us / 1e3, ops[i].second.total_us / 1e3));
  }
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
