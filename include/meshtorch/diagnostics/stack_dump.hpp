#pragma once
// The stacks of every thread of this process, symbolised, written to stderr (the rank's log):
// what the guide gets from `py-spy dump` on each rank, for a C++ program. launch() installs it,
// and then
//   - SIGUSR1 to a rank (meshrun forwards its own SIGUSR1, and `meshrun --dump-stacks` sends it
//     to the meshrun of this node) writes the stacks and the run goes on;
//   - the watchdog writes them before it ends a rank on a stalled or failed collective, and on a
//     fatal signal (the crashing thread's stack included).
//
// How: the watchdog thread sends each other thread a real-time signal whose handler records the
// thread's return addresses (glibc's backtrace(), warmed up once so that it does not load
// libgcc_s inside a handler) into one slot; the watchdog thread then symbolises them with
// backward-cpp (libdw where present: function, file and line) outside any handler. A thread that
// has the signal blocked, or does not run within the wait, is listed as such.
//
// A thread interrupted in a system call sees it restarted (SA_RESTART), or EINTR from the calls
// that are never restarted (poll, epoll_wait, nanosleep); the libraries under LibTorch retry on
// EINTR, as they must for any signal.
#include <string>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

// Installs the capture handler and the SIGUSR1 request, and hands the watchdog its dumper.
// Idempotent.
MESHTORCH_DECL void install_stack_dumps();

// Every thread's stack but the caller's, as text. One capture at a time.
MESHTORCH_DECL std::string all_thread_stacks();

// Writes every thread's stack to stderr, framed so that a log reader finds it.
MESHTORCH_DECL void write_all_thread_stacks(int rank, const std::string& reason);

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(programs)
#include <dirent.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

#if __has_include(<backward.hpp>)
#if __has_include(<elfutils/libdwfl.h>) && !defined(BACKWARD_HAS_DW) && !defined(MESHTORCH_NO_LIBDW)
#define BACKWARD_HAS_DW 1
#endif
#include <backward.hpp>
#define MESHTORCH_HAS_BACKWARD 1
#else
#define MESHTORCH_HAS_BACKWARD 0
#endif

#include <meshtorch/diagnostics/watchdog.hpp>

namespace meshtorch::diagnostics {

namespace stack_dump_detail {

inline constexpr int max_frames = 128;
inline constexpr auto answer_wait = std::chrono::milliseconds(2000);

MESHTORCH_DECL int capture_signal() { return SIGRTMIN + 5; }

MESHTORCH_DECL long thread_id() { return ::syscall(SYS_gettid); }

// The one capture in flight: `owner` is the thread asked; its handler claims the slot by
// negating it (a late answer of a thread given up on finds another owner and writes nothing).
struct Slot {
  std::atomic<long> owner{0};
  std::atomic<bool> done{false};
  void* frames[max_frames];
  int depth = 0;
};

MESHTORCH_DECL Slot& slot() {
  static Slot s;
  return s;
}

extern "C" MESHTORCH_DECL void on_capture_signal(int) {
  Slot& s = slot();
  long expected = thread_id();
  if (!s.owner.compare_exchange_strong(expected, -expected)) return;
  s.depth = ::backtrace(s.frames, max_frames);
  s.done.store(true, std::memory_order_release);
}

MESHTORCH_DECL std::string thread_name(long tid) {
  std::ifstream in(fmt::format("/proc/self/task/{}/comm", tid));
  std::string name;
  std::getline(in, name);
  return name;
}

MESHTORCH_DECL std::vector<long> thread_ids() {
  std::vector<long> ids;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (const dirent* entry = ::readdir(dir))
      if (entry->d_name[0] != '.') ids.push_back(std::atol(entry->d_name));
    ::closedir(dir);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

#if MESHTORCH_HAS_BACKWARD
// backward-cpp's StackTrace, filled with addresses recorded elsewhere (in the signal handler).
class RecordedStack : public backward::StackTrace {
 public:
  RecordedStack(void* const* frames, int depth, int skip) {
    _stacktrace.assign(frames, frames + depth);
    skip_n_firsts(static_cast<std::size_t>(skip));
  }
};
#endif

// The symbolised frames, most recent call last (Python's and backward's order), each resolved once.
MESHTORCH_DECL std::string symbolise(void* const* frames, int depth, int skip) {
#if MESHTORCH_HAS_BACKWARD
  RecordedStack stack(frames, depth, skip);
  backward::TraceResolver resolver;
  resolver.load_stacktrace(stack);
  std::vector<backward::ResolvedTrace> outermost_first;
  for (std::size_t i = stack.size(); i > 0; --i) outermost_first.push_back(resolver.resolve(stack[i - 1]));
  backward::Printer printer;
  printer.snippet = false;
  printer.color_mode = backward::ColorMode::never;
  printer.address = true;
  std::ostringstream out;
  printer.print(outermost_first.begin(), outermost_first.end(), out);
  // The unwinder stops at code without unwind tables (BLAS kernels written in assembly, such as
  // MKL's): the thread was computing there, and its callers cannot be shown.
  if (!outermost_first.empty()) {
    const std::string& outermost = outermost_first.front().object_function;
    if (outermost != "_start" && outermost.rfind("clone", 0) != 0)
      out << "(the stack stops here: a frame without unwind information, such as a BLAS kernel; the thread was "
             "running it)\n";
  }
  return out.str();
#else
  std::string out = "  (addresses only: build with backward-cpp and libdw for names)\n";
  for (int i = depth - 1; i >= skip; --i) out += fmt::format("  #{} {}\n", i - skip, frames[i]);
  return out;
#endif
}

}  // namespace stack_dump_detail

MESHTORCH_DECL std::string all_thread_stacks() {
  namespace d = stack_dump_detail;
  static std::mutex one_at_a_time;
  std::lock_guard lock(one_at_a_time);
  // Set when a handler's unwinder never returned: it still owns the slot, so no capture is safe.
  static bool slot_lost = false;
  if (slot_lost) return "(no stacks: an earlier capture's unwinder never returned)\n";
  const long self = d::thread_id();
  const auto ids = d::thread_ids();
  std::string out;
  for (const long tid : ids) {
    if (tid == self) continue;
    d::Slot& s = d::slot();
    s.done.store(false);
    s.depth = 0;
    s.owner.store(tid);
    const std::string header =
        fmt::format("thread {} ({}){}", tid, d::thread_name(tid), tid == ::getpid() ? ", the main thread" : "");
    if (::syscall(SYS_tgkill, ::getpid(), tid, d::capture_signal()) != 0) {
      s.owner.store(0);
      continue;  // the thread has ended meanwhile
    }
    const auto deadline = std::chrono::steady_clock::now() + d::answer_wait;
    while (!s.done.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    long unclaimed = tid;
    if (!s.done.load(std::memory_order_acquire) && s.owner.compare_exchange_strong(unclaimed, 0)) {
      out += fmt::format("{}: did not answer within {} ms (signals blocked, or not scheduled)\n\n", header,
                         d::answer_wait.count());
      continue;
    }
    // Claimed: the handler is unwinding. Bounded too: an unwinder waiting for a lock the interrupted
    // thread holds would otherwise stop the watchdog thread, and with it the progress reports.
    const auto unwound_by = std::chrono::steady_clock::now() + d::answer_wait;
    while (!s.done.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < unwound_by)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!s.done.load(std::memory_order_acquire)) {
      out += fmt::format("{}: its unwinder did not return within {} ms; no further stacks are taken\n", header,
                         d::answer_wait.count());
      slot_lost = true;
      break;
    }
    // The first two frames are the handler and the kernel's signal trampoline.
    out += header + ":\n" + d::symbolise(s.frames, s.depth, 2) + "\n";
    s.owner.store(0);
  }
  return out;
}

MESHTORCH_DECL void write_all_thread_stacks(int rank, const std::string& reason) {
  const std::string stacks = all_thread_stacks();
  std::cerr << fmt::format(
                   "meshtorch: rank {}: stacks of every thread (pid {}, {}), most recent call last:\n{}"
                   "meshtorch: rank {}: end of stacks\n",
                   rank, ::getpid(), reason, stacks, rank)
            << std::flush;
}

MESHTORCH_DECL void install_stack_dumps() {
  static std::once_flag once;
  std::call_once(once, [] {
    namespace d = stack_dump_detail;
    void* warm_up[4];
    ::backtrace(warm_up, 4);  // loads libgcc_s now, not inside a handler
    struct sigaction capture {};
    capture.sa_handler = d::on_capture_signal;
    sigemptyset(&capture.sa_mask);
    capture.sa_flags = SA_RESTART;
    ::sigaction(d::capture_signal(), &capture, nullptr);
    Watchdog::instance().set_stack_dumper(write_all_thread_stacks);
  });
}

}  // namespace meshtorch::diagnostics
#endif  // MESHTORCH_DEFINES(programs)
