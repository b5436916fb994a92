#pragma once
// The watchdog: one thread per process that publishes this rank's collective progress (per
// group sequence numbers, op, the wait under way) through the rendezvous store about once a
// second, and, once armed (launch() arms it), turns a stalled or failed collective into a clear
// end instead of a hang or a raw backend exception:
//   1. every rank's last published progress is read from the store (a rank stopped with
//      SIGSTOP cannot answer, but what it published last is there) twice, a few seconds apart:
//      a rank whose reports did not advance has stopped;
//   2. analyse_hang() names the culprit (the rank that did not arrive, and its last collective,
//      or the ranks that issued different collectives);
//   3. the flight recorder is dumped to <dir>/rank_<N>.json with what was read of the others,
//      the error is printed and written to the error file (TORCHELASTIC_ERROR_FILE, where
//      meshrun and torchrun look), and the process ends with exit code 124.
// It fires when a CPU wait throws (its timeout, or a peer that vanished), and from its own
// thread when a wait has lasted the timeout plus a grace period (a backend that does not time
// out by itself). NCCL collectives are bounded by ProcessGroupNCCL's own watchdog; this one asks
// the GPU every second which of them it has run, so that a report or dump shows the one stuck on
// the device as waiting.
//
// The dump is also written on request (SIGUSR2, or dump_flight_recorder()) and, best effort, on
// a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, which std::abort raises). Where
// diagnostics/stack_dump.hpp is installed, every thread's stack goes to the log on SIGUSR1, before the
// watchdog ends a rank, and on a fatal signal.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/diagnostics/hang_analysis.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

// The exit code of a process the watchdog ends: a collective timed out or failed.
inline constexpr int watchdog_exit_code = 124;

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto publish_period = std::chrono::seconds(1);

  MESHTORCH_DECL static Watchdog& instance();

  // Starts publishing this rank's progress through `store` (over a connection of its own, so a
  // collective's store traffic never waits behind it). Called by comm::init, which names the host
  // for the dumps.
  MESHTORCH_DECL void attach(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                             std::chrono::milliseconds timeout, std::string host);

  // From now on a collective that fails or stalls ends the process after naming the culprit.
  // `dump_dir` is where the flight recorder is written.
  MESHTORCH_DECL void arm(std::filesystem::path dump_dir);

  // Writes every thread's stack to the log: set by install_stack_dumps() (diagnostics/stack_dump.hpp,
  // which launch() calls), so that only programs that want it link backward-cpp and libdw. From
  // then on SIGUSR1 asks for the stacks, and the watchdog writes them before it ends a rank.
  // Past `deadline` it stops asking threads and gives the rest as addresses.
  using StackDumper = void (*)(int rank, const std::string& reason, Clock::time_point deadline);
  MESHTORCH_DECL void set_stack_dumper(StackDumper dumper);

  bool armed() const { return armed_; }
  std::filesystem::path dump_dir() const {
    std::lock_guard lock(mutex_);
    return dump_dir_;
  }

  // A collective's wait failed (`what` is the backend's message). Unarmed, returns and the
  // caller throws; armed, names the culprit, dumps, and ends the process.
  MESHTORCH_DECL void collective_failed(std::uint64_t record, const std::string& collective, const std::string& what);

  // Writes this rank's dump now; returns its path (empty when there is nowhere to write).
  // `progress` replaces this rank's current progress (the watchdog's, taken before the failure).
  MESHTORCH_DECL std::filesystem::path dump(const std::string& reason, const nlohmann::json& peers,
                                            const HangVerdict* verdict = nullptr,
                                            const nlohmann::json* progress = nullptr);
  // The same without peers (a null `peers`), verdict or progress: a dump on request.
  MESHTORCH_DECL std::filesystem::path dump(const std::string& reason);

  // Every rank's published progress, read twice a few seconds apart: "responsive" says whether
  // its reports advanced in between. {"<rank>": {"responsive": bool, "progress": {...}}}.
  MESHTORCH_DECL nlohmann::json read_peers();

 private:
  // Collectives report their failures here once armed (diagnostics/collective_failure.hpp): unarmed,
  // collective_failed only marks the record failed, which is what happens with no handler.
  MESHTORCH_DECL static void install_failure_handler();

  static constexpr auto store_timeout = std::chrono::seconds(2);
  static constexpr auto grace = std::chrono::seconds(10);
  static constexpr auto fatal_poll = std::chrono::milliseconds(50);

  static std::string progress_key(int rank) { return "meshtorch/progress/" + std::to_string(rank); }
  static std::string to_string(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

  c10::intrusive_ptr<c10d::Store> current_store() {
    std::lock_guard lock(mutex_);
    return store_;
  }

  MESHTORCH_DECL void publish();

  MESHTORCH_DECL void loop();

  MESHTORCH_DECL void stop();

  [[noreturn]] MESHTORCH_DECL void end_process(std::uint64_t record, const std::string& what);

  void write_stacks(const std::string& reason, Clock::time_point deadline = Clock::time_point::max()) {
    if (const auto dumper = stack_dumper_.load()) dumper(rank_, reason, deadline);
  }

  // The torchelastic error file, with the culprit for meshrun's summary.
  MESHTORCH_DECL void write_error_file(const std::string& message, const HangVerdict& verdict,
                                       const std::filesystem::path& dump);

  MESHTORCH_DECL static void install_signal_handlers();

  // The dump is written by the watchdog thread: the thread the signal interrupted may hold a
  // lock (malloc's, the recorder's) that writing it needs. This one waits for the dump and the
  // stacks, at most fatal_budget().
  MESHTORCH_DECL static void on_fatal_signal(int signo);

 public:
  // How long a rank that received a fatal signal may take to write its dump and stacks before it
  // dies: half the collective timeout, within [2 s, 10 s]. Its peers wait for it in a collective
  // and end at the timeout; it must be gone first, so that the launcher names it, not them.
  static constexpr std::chrono::milliseconds fatal_budget(std::chrono::milliseconds timeout) {
    return std::clamp<std::chrono::milliseconds>(timeout / 2, std::chrono::seconds(2), std::chrono::seconds(10));
  }

 private:
  mutable std::mutex mutex_;
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_ = 0, world_size_ = 1;
  std::string host_;  // in the dumps
  std::chrono::milliseconds timeout_{600'000};
  std::filesystem::path dump_dir_;
  std::atomic<bool> armed_{false}, ending_{false}, dump_requested_{false}, store_answers_{true};
  std::atomic<std::int64_t> beat_{0};
  std::atomic<int> fatal_signal_{0};
  std::atomic<bool> stacks_requested_{false};
  std::atomic<StackDumper> stack_dumper_{nullptr};
  std::atomic<bool> fatal_dump_done_{false};
  // Set by attach() from the timeout, read in the signal handler; the signal's time, in
  // steady-clock ticks, for the stacks' deadline.
  std::atomic<std::int64_t> fatal_budget_ms_{fatal_budget(std::chrono::milliseconds(600'000)).count()};
  std::atomic<Clock::rep> fatal_at_{0};

  std::once_flag started_;
  std::thread thread_;
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
};

// Writes this rank's flight recorder dump now (to the armed dump folder); returns its path.
inline std::filesystem::path dump_flight_recorder(const std::string& reason = "request") {
  return Watchdog::instance().dump(reason);
}

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(programs)
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <string.h>
#include <time.h>

#include <meshtorch/diagnostics/collective_failure.hpp>
#include <meshtorch/diagnostics/flight_recorder.hpp>

namespace meshtorch::diagnostics {

MESHTORCH_DECL Watchdog& Watchdog::instance() {
  // Never destroyed: its thread is stopped by an atexit handler, and signal handlers use it.
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

MESHTORCH_DECL void Watchdog::attach(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                     std::chrono::milliseconds timeout, std::string host) {
  c10::intrusive_ptr<c10d::Store> own;
  try {
    own = store->clone();
    own->setTimeout(store_timeout);
  } catch (const std::exception&) {
    own = store;  // a store that cannot be cloned is shared
  }
  {
    std::lock_guard lock(mutex_);
    store_ = std::move(own);
    rank_ = rank;
    world_size_ = world_size;
    host_ = std::move(host);
    timeout_ = timeout;
    fatal_budget_ms_ = fatal_budget(timeout).count();
  }
  std::call_once(started_, [this] {
    thread_ = std::thread([this] { loop(); });
    std::atexit([] { instance().stop(); });
  });
}

MESHTORCH_DECL void Watchdog::arm(std::filesystem::path dump_dir) {
  {
    std::lock_guard lock(mutex_);
    dump_dir_ = std::move(dump_dir);
    armed_ = true;
  }
  install_failure_handler();
  install_signal_handlers();
}

MESHTORCH_DECL void Watchdog::set_stack_dumper(StackDumper dumper) {
  stack_dumper_ = dumper;
  struct sigaction request {};
  request.sa_handler = [](int) { instance().stacks_requested_ = true; };
  sigemptyset(&request.sa_mask);
  request.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &request, nullptr);
}

MESHTORCH_DECL void Watchdog::collective_failed(std::uint64_t record, const std::string& collective,
                                                const std::string& what) {
  if (!armed_) {
    FlightRecorder::instance().failed(record);
    return;
  }
  // The backend's message without its C++ stack: its first line says what happened.
  end_process(record, fmt::format("{} failed: {}", collective, what.substr(0, what.find('\n'))));
}

MESHTORCH_DECL std::filesystem::path Watchdog::dump(const std::string& reason, const nlohmann::json& peers,
                                                    const HangVerdict* verdict, const nlohmann::json* progress) {
  std::filesystem::path dir = dump_dir();
  if (dir.empty()) return {};
  nlohmann::json out = {
      {"format", "meshtorch-flight-recorder"},
      {"version", 1},
      {"rank", rank_},
      {"world_size", world_size_},
      {"pid", static_cast<long>(::getpid())},
      {"host", host_},
      {"reason", reason},
      {"time_s", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()},
      {"timeout_s", std::chrono::duration<double>(timeout_).count()},
      {"progress", progress ? *progress : FlightRecorder::instance().progress()},
      {"entries", FlightRecorder::instance().entries()}};
  if (!peers.is_null()) out["peers"] = peers;
  if (verdict)
    out["verdict"] = {{"culprits", verdict->culprits}, {"summary", verdict->summary}, {"details", verdict->details}};
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  const auto path = dir / fmt::format("rank_{}.json", rank_);
  const auto temporary = dir / fmt::format(".rank_{}.json.tmp", rank_);
  {
    std::ofstream file(temporary, std::ios::trunc);
    file << out.dump(1) << "\n";
    if (!file) return {};
  }
  std::filesystem::rename(temporary, path, error);
  return error ? std::filesystem::path{} : path;
}

MESHTORCH_DECL std::filesystem::path Watchdog::dump(const std::string& reason) { return dump(reason, nullptr); }

MESHTORCH_DECL nlohmann::json Watchdog::read_peers() {
  auto store = current_store();
  nlohmann::json peers = nlohmann::json::object();
  if (!store) return peers;
  auto read_all = [&](std::map<int, nlohmann::json>& into) {
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      try {
        if (!store->check({progress_key(r)})) continue;
        into[r] = nlohmann::json::parse(to_string(store->get(progress_key(r))), nullptr, false);
      } catch (const std::exception&) {
        store_answers_ = false;  // the store itself (rank 0's) does not answer
        return;
      }
    }
  };
  std::map<int, nlohmann::json> first, second;
  read_all(first);
  if (store_answers_) {
    std::this_thread::sleep_for(publish_period * 2 + std::chrono::milliseconds(300));
    read_all(second);
  }
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    auto now = second.count(r) ? second[r] : first.count(r) ? first[r] : nlohmann::json();
    const bool advanced =
        first.count(r) && second.count(r) && first[r].value("beat", -1) != second[r].value("beat", -1);
    nlohmann::json peer = {{"responsive", store_answers_ && advanced}};
    if (now.is_object() && now.contains("progress")) peer["progress"] = now["progress"];
    // Rank 0 serves the store: a store that stopped answering means rank 0 stopped.
    if (!store_answers_ && r != 0 && first.count(r)) peer["responsive"] = true;
    if (!store_answers_ && r != 0 && !first.count(r)) continue;
    peers[std::to_string(r)] = std::move(peer);
  }
  return peers;
}

MESHTORCH_DECL void Watchdog::install_failure_handler() {
  set_collective_failure_handler([](std::uint64_t record, const std::string& collective, const std::string& what) {
    instance().collective_failed(record, collective, what);
  });
}

MESHTORCH_DECL void Watchdog::publish() {
  auto store = current_store();
  if (!store || !store_answers_) return;
  const nlohmann::json message = {{"beat", ++beat_}, {"progress", FlightRecorder::instance().progress()}};
  const std::string text = message.dump();
  try {
    store->set(progress_key(rank_), std::vector<uint8_t>(text.begin(), text.end()));
  } catch (const std::exception&) {
    // Rank 0 (the store) has ended or stopped: nothing to publish to any more.
  }
}

MESHTORCH_DECL void Watchdog::loop() {
  // Process-directed signals go to the other threads, so that a fatal one finds this thread
  // free to write the dump.
  sigset_t fatal;
  sigemptyset(&fatal);
  for (int signo : {SIGABRT, SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaddset(&fatal, signo);
  pthread_sigmask(SIG_BLOCK, &fatal, nullptr);
  std::unique_lock lock(wake_mutex_);
  auto next_publish = Clock::now();
  while (!stopping_) {
    lock.unlock();
    if (const int signo = fatal_signal_) {
      const char* name = ::sigabbrev_np(signo);
      const std::string reason = std::string("fatal signal SIG") + (name ? name : "?");
      dump(reason);
      // The stacks end a little before the handler stops waiting, so that what was named is written.
      const auto budget = std::chrono::milliseconds(fatal_budget_ms_.load());
      write_stacks(reason, Clock::time_point(Clock::duration(fatal_at_.load())) + budget * 4 / 5);
      fatal_dump_done_ = true;
      return;
    }
    if (Clock::now() < next_publish) {
      lock.lock();
      wake_.wait_for(lock, fatal_poll, [this] { return stopping_; });
      continue;
    }
    next_publish = Clock::now() + publish_period;
    FlightRecorder::instance().poll_device_completions();  // NCCL's, which no host wait ends
    publish();
    if (stacks_requested_.exchange(false)) write_stacks("request (SIGUSR1)");
    if (dump_requested_.exchange(false)) {
      const auto path = dump("request (SIGUSR2)");
      if (!path.empty())
        std::cerr << fmt::format("meshtorch: rank {}: flight recorder written to {}\n", rank_, path.string());
    }
    if (armed_) {
      if (auto wait = FlightRecorder::instance().longest_wait();
          wait && wait->seconds > std::chrono::duration<double>(timeout_ + grace).count())
        end_process(wait->id, fmt::format("{} #{} over the {} has not completed after {:.0f} s (timeout {:.0f} s)",
                                          wait->op, wait->seq, wait->group, wait->seconds,
                                          std::chrono::duration<double>(timeout_).count()));
    }
    lock.lock();
    wake_.wait_for(lock, fatal_poll, [this] { return stopping_; });
  }
}

MESHTORCH_DECL void Watchdog::stop() {
  // The process is ending while another thread names the culprit (a failure seen both by the
  // main thread, as an exception, and by the watchdog): that thread ends it, with code 124.
  if (ending_)
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  {
    std::lock_guard lock(wake_mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

MESHTORCH_DECL void Watchdog::end_process(std::uint64_t record, const std::string& what) {
  // One thread tells the story; any other that fails meanwhile waits for the exit.
  if (ending_.exchange(true))
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  const nlohmann::json own = FlightRecorder::instance().progress();
  // The store is read on a thread of its own: a store whose server (rank 0) is stopped may not
  // answer at all, and the verdict must come in time all the same.
  auto answer = std::make_shared<std::promise<nlohmann::json>>();
  auto peers_future = answer->get_future();
  std::thread([this, answer] {
    publish();  // the progress others read must show this wait
    answer->set_value(read_peers());
  }).detach();
  nlohmann::json peers = nlohmann::json::object();
  if (peers_future.wait_for(publish_period * 2 + store_timeout * 2) == std::future_status::ready)
    peers = peers_future.get();
  else
    store_answers_ = false;
  // Rank 0 serves the store: a store that does not answer means rank 0 stopped.
  if (!store_answers_ && rank_ != 0) peers["0"] = {{"responsive", false}};
  std::map<int, RankReport> reports;
  for (const auto& [key, peer] : peers.items()) {
    RankReport report = rank_report_from_progress(std::stoi(key), peer.value("progress", nlohmann::json()));
    report.responsive = peer.value("responsive", true);
    reports[report.rank] = std::move(report);
  }
  RankReport mine = rank_report_from_progress(rank_, own);
  add_ring(mine, FlightRecorder::instance().entries());
  reports[rank_] = std::move(mine);
  const HangVerdict verdict = analyse_hang(reports);
  FlightRecorder::instance().failed(record);
  const auto path = dump("collective timeout or failure", peers, &verdict, &own);

  std::string message = fmt::format("rank {}: {}", rank_, what);
  std::string culprit = verdict.text();
  if (!store_answers_) culprit += "\n  the rendezvous store (served by rank 0) did not answer within 2 s";
  std::string text = fmt::format("meshtorch: {}\nmeshtorch: culprit: {}\n", message, culprit);
  if (!path.empty())
    text += fmt::format("meshtorch: flight recorder written to {}; meshtorch-diagnose {} reads every rank's dump\n",
                        path.string(), path.parent_path().string());
  std::cerr << text << std::flush;
  std::fflush(stdout);
  write_error_file(message, verdict, path);
  write_stacks("the watchdog ends this rank: " + verdict.summary);
  std::_Exit(watchdog_exit_code);
}

MESHTORCH_DECL void Watchdog::write_error_file(const std::string& message, const HangVerdict& verdict,
                                               const std::filesystem::path& dump) {
  const char* file_name = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!file_name || !*file_name) return;
  nlohmann::json error = {{"message",
                           {{"message", message + "; culprit: " + verdict.summary},
                            {"extraInfo",
                             {{"py_callstack", verdict.text()},
                              {"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                                               std::chrono::system_clock::now().time_since_epoch())
                                                               .count())},
                              {"culprit_ranks", verdict.culprits},
                              {"culprit", verdict.summary},
                              {"flight_recorder", dump.empty() ? std::string() : dump.parent_path().string()}}}}}};
  std::ofstream file(file_name, std::ios::trunc);
  file << error.dump() << "\n";
}

MESHTORCH_DECL void Watchdog::install_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    (void)FlightRecorder::instance();  // built here, not in the fatal signal's handler
    struct sigaction request {};
    request.sa_handler = [](int) { instance().dump_requested_ = true; };
    sigemptyset(&request.sa_mask);
    request.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR2, &request, nullptr);
    struct sigaction fatal {};
    fatal.sa_handler = on_fatal_signal;
    sigemptyset(&fatal.sa_mask);
    fatal.sa_flags = SA_RESETHAND | SA_NODEFER;
    for (int signo : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::sigaction(signo, &fatal, nullptr);
  });
}

MESHTORCH_DECL void Watchdog::on_fatal_signal(int signo) {
  static std::atomic<bool> once{false};
  if (!once.exchange(true)) {
    auto& watchdog = instance();
    const std::int64_t budget_ms = watchdog.fatal_budget_ms_.load();
    ::alarm(static_cast<unsigned>(budget_ms / 1000 + 5));  // should the waiting below hang, SIGALRM ends it
    watchdog.fatal_at_ = Clock::now().time_since_epoch().count();
    // This thread may hold the recorder's lock, and never release it: the watchdog stops waiting for it.
    FlightRecorder::instance().reading_after_fatal_signal();
    watchdog.fatal_signal_ = signo;
    // Against the clock (clock_gettime is async-signal-safe): a loaded machine oversleeps.
    const auto until = Clock::now() + std::chrono::milliseconds(budget_ms);
    while (!watchdog.fatal_dump_done_ && Clock::now() < until) {
      timespec pause{0, 10'000'000};
      ::nanosleep(&pause, nullptr);
    }
  }
  ::signal(signo, SIG_DFL);
  ::raise(signo);
}

}  // namespace meshtorch::diagnostics
#endif  // MESHTORCH_DEFINES(programs)
