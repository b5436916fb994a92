#pragma once
// The flight recorder: per process a ring buffer of the last collectives (record id, group,
// per-group sequence number, op, shape, dtype, issue/wait/end times, state), as PyTorch's NCCL
// flight recorder keeps. Collectives record themselves when issued (comm::detail::issue) and
// when their wait ends (Work::wait; on a GPU, when the stream that waited has run them); a dump
// is the JSON that meshtorch-diagnose reads.
//
// Recording is one uncontended mutex, a hash lookup of the group and a copy into a ring slot
// whose buffers are reused: a few hundred ns, no allocation once the ring is warm (an op name
// over 15 characters aside). No store traffic here: the watchdog publishes progress from its
// own thread. Standard library and nlohmann-json only, so tools read dumps without LibTorch.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

// How a point-to-point message is named in the records: "send to 3", "recv from 1" (global ranks;
// comm/point_to_point.hpp). The hang analysis reads the peer back from the name.
inline constexpr std::string_view send_prefix = "send to ";
inline constexpr std::string_view receive_prefix = "recv from ";

enum class CollectiveState { scheduled, waiting, completed, failed };

inline const char* to_string(CollectiveState state) {
  switch (state) {
    case CollectiveState::scheduled:
      return "scheduled";
    case CollectiveState::waiting:
      return "waiting";
    case CollectiveState::completed:
      return "completed";
    default:
      return "failed";
  }
}

// The collective a caller's description names ("FSDP all_gather of 'model.layers.3' on rank 0"
// is an all_gather): what ranks compare, since descriptions may name the rank.
MESHTORCH_DECL std::string_view collective_kind(std::string_view op);

// One process group as the recorder knows it: its name (the same on every member, so dumps of
// different ranks can be matched) and its collective counters.
struct RecordedGroup {
  std::string name;  // "FSDP group [0, 1] (gloo)"
  std::vector<int> ranks;
  std::string axis;
  std::uint64_t issued = 0;     // sequence number of the last collective issued on it
  std::uint64_t completed = 0;  // highest sequence number whose wait returned
  std::string last_op;
};

struct FlightEntry {
  std::uint64_t id = 0;  // 1, 2, ... over all groups of this process
  const RecordedGroup* group = nullptr;
  std::uint64_t seq = 0;
  std::string op;      // all_reduce, all_gather, ...
  std::string detail;  // the caller's description when it says more than the op
  std::vector<std::int64_t> shape;
  const char* dtype = "";
  std::chrono::steady_clock::time_point issued, wait_started, ended;
  CollectiveState state = CollectiveState::scheduled;
  // Set while a device stream, not the host, waits for it (NCCL): true once the device has run it.
  std::function<bool()> done_on_device;
};

// A collective whose wait has lasted longest: what the watchdog checks against the timeout.
struct PendingCollective {
  std::uint64_t id = 0;
  std::string group, op;
  std::uint64_t seq = 0;
  double seconds = 0;  // since its wait began
};

class FlightRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  // MESHTORCH_FLIGHT_RECORDER_ENTRIES (default 2000) sets the ring's length; 0 turns it off.
  MESHTORCH_DECL static FlightRecorder& instance();

  explicit FlightRecorder(std::size_t capacity) : ring_(capacity) {}

  bool enabled() const { return !ring_.empty(); }
  std::size_t capacity() const { return ring_.size(); }

  // Records a collective being issued on the group `backend` (any pointer unique to the group's
  // communicator); returns its id, 0 when the recorder is off.
  // `op` is the collective or the caller's description of it.
  MESHTORCH_DECL std::uint64_t record(const void* backend, std::string_view axis, const std::vector<int>& ranks,
                                      std::string_view backend_name, std::string_view op,
                                      std::span<const std::int64_t> shape, const char* dtype);

  void waiting(std::uint64_t id) { set_state(id, CollectiveState::waiting); }
  void completed(std::uint64_t id) { set_state(id, CollectiveState::completed); }
  void failed(std::uint64_t id) { set_state(id, CollectiveState::failed); }

  // For a wait that only ordered a device stream after the collective (NCCL's wait returns at
  // once): it stays waiting until `done` says the device has run it, which
  // poll_device_completions() asks. Marking it completed at the wait would leave a collective
  // stuck on the GPU looking finished in every report and dump.
  MESHTORCH_DECL void completes_when(std::uint64_t id, std::function<bool()> done);

  // Marks completed the collectives whose device has run them; the watchdog calls it every
  // second. A `done` that throws (a broken device context) leaves its collective waiting.
  // Returns how many it marked.
  MESHTORCH_DECL std::size_t poll_device_completions();

  // The collective waited on longest, if any wait is under way.
  MESHTORCH_DECL std::optional<PendingCollective> longest_wait() const;

  // progress() and entries() are for the watchdog's reports and dumps. They are templates
  // (Json is always nlohmann::json) so that their JSON is compiled only where they are used,
  // which includes <nlohmann/json.hpp>: every collective's code includes this header.

  // This process's progress: per group the last sequence number issued and completed, the
  // last collective, and the wait under way. What the watchdog publishes through the store.
  template <class Json = nlohmann::json>
  Json progress() const {
    const auto lock = lock_for_watchdog();
    Json out = {{"groups", Json::array()}};
    for (const auto& group : groups_)
      out["groups"].push_back({{"group", group->name},
                               {"axis", group->axis},
                               {"ranks", group->ranks},
                               {"issued", group->issued},
                               {"completed", group->completed},
                               {"op", group->last_op}});
    if (const FlightEntry* last = find(last_)) out["last"] = brief<Json>(*last);
    const FlightEntry* oldest = nullptr;
    for (const auto& entry : ring_)
      if (entry.id && entry.state == CollectiveState::waiting && (!oldest || entry.id < oldest->id)) oldest = &entry;
    if (oldest) {
      out["waiting"] = brief<Json>(*oldest);
      out["waiting"]["seconds"] = std::chrono::duration<double>(Clock::now() - oldest->wait_started).count();
    }
    return out;
  }

  // The ring, oldest first, with wall-clock times (seconds since the epoch).
  template <class Json = nlohmann::json>
  Json entries() const {
    const auto lock = lock_for_watchdog();
    const double offset = wall_offset();
    auto wall = [&](Clock::time_point t) -> Json {
      if (t == Clock::time_point{}) return nullptr;
      return std::chrono::duration<double>(t.time_since_epoch()).count() + offset;
    };
    Json out = Json::array();
    const std::uint64_t first = next_id_ >= ring_.size() ? next_id_ - ring_.size() + 1 : 1;
    for (std::uint64_t id = first; id <= next_id_; ++id) {
      const FlightEntry& e = ring_[id % ring_.size()];
      if (e.id != id) continue;
      auto entry = brief<Json>(e);
      entry["id"] = e.id;
      entry["ranks"] = e.group->ranks;
      if (!e.detail.empty()) entry["detail"] = e.detail;
      entry["issued_s"] = wall(e.issued);
      entry["wait_started_s"] = wall(e.wait_started);
      entry["ended_s"] = wall(e.ended);
      out.push_back(std::move(entry));
    }
    return out;
  }

  // Called from a fatal signal's handler (an atomic store). From then on the watchdog's waits for
  // the lock end: the thread that holds it may be the one the signal stopped, which never releases
  // it. progress() and entries() then read without it, which is safe enough for a last dump: every
  // other writer waits for that lock, so the ring no longer changes. longest_wait() and
  // poll_device_completions() give nothing.
  void reading_after_fatal_signal() { after_fatal_signal_.store(true, std::memory_order_relaxed); }

 private:
  friend struct FlightRecorderTestAccess;  // holds the lock where a test needs it held
  static constexpr auto fatal_lock_wait = std::chrono::milliseconds(500);

  // The lock for the watchdog thread, which must never wait for ever: owned, or after a fatal
  // signal and fatal_lock_wait without it, not owned.
  // Once one wait has ended so, the next ones only try.
  std::unique_lock<std::timed_mutex> lock_for_watchdog() const {
    std::unique_lock lock(mutex_, std::defer_lock);
    if (lock_abandoned_.load(std::memory_order_relaxed)) {
      (void)lock.try_lock();
      return lock;
    }
    std::chrono::milliseconds waited_after_signal{0};
    constexpr auto slice = std::chrono::milliseconds(50);
    while (!lock.try_lock_for(slice))
      if (after_fatal_signal_.load(std::memory_order_relaxed) && (waited_after_signal += slice) >= fatal_lock_wait) {
        lock_abandoned_.store(true, std::memory_order_relaxed);
        break;
      }
    return lock;
  }

  MESHTORCH_DECL static std::size_t capacity_from_env();

  static double wall_offset() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
           std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  }

  // With the tensor's shape and dtype, so that a desync of sizes or types is named too.
  template <class Json>
  static Json brief(const FlightEntry& e) {
    return {{"group", e.group->name},      {"seq", e.seq},     {"op", e.op},
            {"state", to_string(e.state)}, {"shape", e.shape}, {"dtype", e.dtype}};
  }

  MESHTORCH_DECL RecordedGroup& group_of(const void* backend, std::string_view axis, const std::vector<int>& ranks,
                                         std::string_view backend_name);

  FlightEntry* find(std::uint64_t id) {
    if (!id || ring_.empty()) return nullptr;
    FlightEntry& entry = ring_[id % ring_.size()];
    return entry.id == id ? &entry : nullptr;
  }
  const FlightEntry* find(std::uint64_t id) const { return const_cast<FlightRecorder*>(this)->find(id); }

  MESHTORCH_DECL void set_state(std::uint64_t id, CollectiveState state);
  MESHTORCH_DECL void set_state_locked(FlightEntry& entry, CollectiveState state);

  mutable std::timed_mutex mutex_;
  std::atomic<bool> after_fatal_signal_{false};
  mutable std::atomic<bool> lock_abandoned_{false};
  std::vector<FlightEntry> ring_;
  std::uint64_t next_id_ = 0, last_ = 0;
  std::deque<std::unique_ptr<RecordedGroup>> groups_;
  std::unordered_map<const void*, RecordedGroup*> by_backend_;
};

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <cstdlib>

namespace meshtorch::diagnostics {

MESHTORCH_DECL std::string_view collective_kind(std::string_view op) {
  for (std::string_view kind : {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier"})
    if (op.find(kind) != std::string_view::npos) return kind;
  return op;
}

MESHTORCH_DECL FlightRecorder& FlightRecorder::instance() {
  // Never destroyed: the watchdog thread and signal handlers may read it during exit.
  static FlightRecorder* recorder = new FlightRecorder(capacity_from_env());
  return *recorder;
}

MESHTORCH_DECL std::uint64_t FlightRecorder::record(const void* backend, std::string_view axis,
                                                    const std::vector<int>& ranks, std::string_view backend_name,
                                                    std::string_view op, std::span<const std::int64_t> shape,
                                                    const char* dtype) {
  if (ring_.empty()) return 0;
  const auto now = Clock::now();
  std::lock_guard lock(mutex_);
  RecordedGroup& group = group_of(backend, axis, ranks, backend_name);
  const std::uint64_t id = ++next_id_;
  FlightEntry& entry = ring_[id % ring_.size()];
  entry.id = id;
  entry.group = &group;
  entry.seq = ++group.issued;
  const std::string_view kind = collective_kind(op);
  entry.op.assign(kind);
  if (kind.size() == op.size())
    entry.detail.clear();
  else
    entry.detail.assign(op);
  entry.shape.assign(shape.begin(), shape.end());
  entry.dtype = dtype ? dtype : "";
  entry.issued = now;
  entry.wait_started = entry.ended = {};
  entry.state = CollectiveState::scheduled;
  entry.done_on_device = nullptr;
  if (group.last_op != kind) group.last_op.assign(kind);
  last_ = id;
  return id;
}

MESHTORCH_DECL std::optional<PendingCollective> FlightRecorder::longest_wait() const {
  const auto lock = lock_for_watchdog();
  if (!lock.owns_lock()) return std::nullopt;
  const auto now = Clock::now();
  const FlightEntry* oldest = nullptr;
  for (const auto& entry : ring_)
    if (entry.id && entry.state == CollectiveState::waiting && (!oldest || entry.wait_started < oldest->wait_started))
      oldest = &entry;
  if (!oldest) return std::nullopt;
  return PendingCollective{oldest->id, oldest->group->name, oldest->op, oldest->seq,
                           std::chrono::duration<double>(now - oldest->wait_started).count()};
}

MESHTORCH_DECL void FlightRecorder::completes_when(std::uint64_t id, std::function<bool()> done) {
  if (!id) return;
  std::lock_guard lock(mutex_);
  if (FlightEntry* entry = find(id); entry && entry->state == CollectiveState::waiting)
    entry->done_on_device = std::move(done);
}

MESHTORCH_DECL std::size_t FlightRecorder::poll_device_completions() {
  // The device is asked outside the lock, so that a slow query never holds up a collective's
  // recording; oldest first, as one stream runs them.
  std::vector<std::pair<std::uint64_t, std::function<bool()>>> pending;
  {
    const auto lock = lock_for_watchdog();
    if (!lock.owns_lock()) return 0;
    for (const auto& entry : ring_)
      if (entry.id && entry.done_on_device) pending.emplace_back(entry.id, entry.done_on_device);
  }
  std::sort(pending.begin(), pending.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::size_t marked = 0;
  for (const auto& [id, done] : pending) {
    bool finished = false;
    try {
      finished = done();
    } catch (...) {
    }
    if (!finished) continue;
    const auto lock = lock_for_watchdog();
    if (!lock.owns_lock()) return marked;
    FlightEntry* entry = find(id);
    if (!entry || !entry->done_on_device) continue;  // overwritten, or ended otherwise, meanwhile
    set_state_locked(*entry, CollectiveState::completed);
    ++marked;
  }
  return marked;
}

MESHTORCH_DECL std::size_t FlightRecorder::capacity_from_env() {
  if (const char* text = std::getenv("MESHTORCH_FLIGHT_RECORDER_ENTRIES"); text && *text) {
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    if (end && *end == '\0' && value >= 0 && value <= 10'000'000) return static_cast<std::size_t>(value);
  }
  return 2000;
}

MESHTORCH_DECL RecordedGroup& FlightRecorder::group_of(const void* backend, std::string_view axis,
                                                       const std::vector<int>& ranks, std::string_view backend_name) {
  auto found = by_backend_.find(backend);
  // A backend freed and another allocated at its address is a new group.
  if (found != by_backend_.end() && found->second->axis == axis && found->second->ranks == ranks) return *found->second;
  std::string name = std::string(axis) + " group [";
  for (std::size_t i = 0; i < ranks.size(); ++i) name += (i ? ", " : "") + std::to_string(ranks[i]);
  name += "]";
  if (!backend_name.empty()) name += " (" + std::string(backend_name) + ")";
  for (auto& group : groups_)
    if (group->name == name) {
      // The same ranks over a new communicator (a mesh made again): its counters start again.
      group->issued = group->completed = 0;
      group->last_op.clear();
      return *(by_backend_[backend] = group.get());
    }
  groups_.push_back(std::make_unique<RecordedGroup>(RecordedGroup{name, ranks, std::string(axis)}));
  return *(by_backend_[backend] = groups_.back().get());
}

MESHTORCH_DECL void FlightRecorder::set_state(std::uint64_t id, CollectiveState state) {
  if (!id) return;
  std::lock_guard lock(mutex_);
  if (FlightEntry* entry = find(id)) set_state_locked(*entry, state);  // else the ring wrapped meanwhile
}

MESHTORCH_DECL void FlightRecorder::set_state_locked(FlightEntry& entry, CollectiveState state) {
  const auto now = Clock::now();
  entry.state = state;
  if (state == CollectiveState::waiting) {
    entry.wait_started = now;
    return;
  }
  entry.ended = now;
  entry.done_on_device = nullptr;
  auto& group = const_cast<RecordedGroup&>(*entry.group);
  if (state == CollectiveState::completed && entry.seq > group.completed) group.completed = entry.seq;
}

}  // namespace meshtorch::diagnostics
#endif  // MESHTORCH_DEFINES(core)
