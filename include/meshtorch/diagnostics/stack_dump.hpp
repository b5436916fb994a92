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
// backward-cpp (libdw where present: function, file and line) outside any handler, with one
// resolver for all of them. A thread that has the signal blocked, or does not run within the wait,
// is listed as such. On a fatal signal the stacks have a deadline (Watchdog::fatal_budget): what
// is not named by then is given as addresses.
//
// A thread interrupted in a system call sees it restarted (SA_RESTART), or EINTR from the calls
// that are never restarted (poll, epoll_wait, nanosleep); the libraries under LibTorch retry on
// EINTR, as they must for any signal.
#include <chrono>
#include <string>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

// Installs the capture handler and the SIGUSR1 request, and hands the watchdog its dumper.
// Idempotent.
MESHTORCH_DECL void install_stack_dumps();

// Every thread's stack but the caller's, as text. One capture at a time. Past `deadline` no
// further thread is asked, and the stacks not yet symbolised are given as addresses: a rank that
// crashed must be gone before its peers time out, or the launcher would name one of them first.
MESHTORCH_DECL std::string all_thread_stacks(
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());

// Writes every thread's stack to stderr, framed so that a log reader finds it.
MESHTORCH_DECL void write_all_thread_stacks(int rank, const std::string& reason,
                                            std::chrono::steady_clock::time_point deadline);

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(programs)
#include <dirent.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>
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
  // The main thread first (where a crash or a hang usually is: it is asked first when time is
  // short), then the others by thread id.
  const long main_thread = ::getpid();
  std::sort(ids.begin(), ids.end(),
            [main_thread](long a, long b) { return std::pair(a != main_thread, a) < std::pair(b != main_thread, b); });
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

// Frames as bare addresses, most recent call last: what is given when there is no time, or no
// backward-cpp, to name them.
MESHTORCH_DECL std::string addresses(void* const* frames, int depth, int skip, const char* why) {
  std::string out = fmt::format("  (addresses only: {})\n", why);
  for (int i = depth - 1; i >= skip; --i) out += fmt::format("  #{} {}\n", i - skip, frames[i]);
  return out;
}

#if MESHTORCH_HAS_BACKWARD
// One resolver serves every thread of a capture: libdw reads each library's symbols once (for
// LibTorch's, seconds on a loaded machine), not once per thread.
class Symboliser {
 public:
  // The symbolised frames, most recent call last (Python's and backward's order).
  std::string operator()(void* const* frames, int depth, int skip) {
    RecordedStack stack(frames, depth, skip);
    resolver_.load_stacktrace(stack);
    std::vector<backward::ResolvedTrace> outermost_first;
    for (std::size_t i = stack.size(); i > 0; --i) outermost_first.push_back(resolver_.resolve(stack[i - 1]));
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
  }

 private:
  backward::TraceResolver resolver_;
};
#else
struct Symboliser {
  std::string operator()(void* const* frames, int depth, int skip) {
    return addresses(frames, depth, skip, "build with backward-cpp and libdw for names");
  }
};
#endif

// One thread's return addresses, recorded by its handler.
struct CapturedStack {
  long tid = 0;
  std::string header;
  std::vector<void*> frames;
  std::string failure;  // why there are no frames
};

// Every thread's stack but the caller's, each piece handed to `emit` as soon as it is ready, so
// that what was named is kept even when the process ends before the rest.
MESHTORCH_DECL void emit_thread_stacks(std::chrono::steady_clock::time_point deadline,
                                       const std::function<void(const std::string&)>& emit) {
  namespace d = stack_dump_detail;
  using Clock = std::chrono::steady_clock;
  static std::mutex one_at_a_time;
  std::lock_guard lock(one_at_a_time);
  // Set when a handler's unwinder never returned: it still owns the slot, so no capture is safe.
  static bool slot_lost = false;
  if (slot_lost) return emit("(no stacks: an earlier capture's unwinder never returned)\n");
  const long self = d::thread_id();
  const auto ids = d::thread_ids();
  // First every thread's addresses (a few microseconds each when it answers), then the names: so
  // that a deadline cuts the slow part, and every thread is asked at about the same moment.
  // Half the time left goes to asking, half to naming: a thread that does not answer must not
  // leave the others unnamed.
  const auto started = Clock::now();
  const auto ask_until = deadline == Clock::time_point::max() ? deadline : started + (deadline - started) / 2;
  std::vector<d::CapturedStack> captured;
  std::size_t not_asked = 0;
  std::size_t left = ids.size() - static_cast<std::size_t>(std::count(ids.begin(), ids.end(), self));
  for (const long tid : ids) {
    if (tid == self) continue;
    const std::size_t share = left--;  // this thread's share of the time left to ask
    if (Clock::now() >= ask_until) {
      ++not_asked;
      continue;
    }
    d::CapturedStack& stack = captured.emplace_back();
    stack.tid = tid;
    stack.header =
        fmt::format("thread {} ({}){}", tid, d::thread_name(tid), tid == ::getpid() ? ", the main thread" : "");
    d::Slot& s = d::slot();
    s.done.store(false);
    s.depth = 0;
    s.owner.store(tid);
    if (::syscall(SYS_tgkill, ::getpid(), tid, d::capture_signal()) != 0) {
      s.owner.store(0);
      captured.pop_back();  // the thread has ended meanwhile
      continue;
    }
    const auto wait_until = [&](Clock::time_point limit) {
      while (!s.done.load(std::memory_order_acquire) && Clock::now() < limit)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    const auto asked = Clock::now();
    const auto answer_by =
        ask_until == Clock::time_point::max()
            ? asked + d::answer_wait
            : std::min(asked + d::answer_wait, asked + (ask_until - asked) / static_cast<std::int64_t>(share));
    wait_until(answer_by);
    long unclaimed = tid;
    if (!s.done.load(std::memory_order_acquire) && s.owner.compare_exchange_strong(unclaimed, 0)) {
      stack.failure = fmt::format("did not answer within {} ms (signals blocked, or not scheduled)",
                                  std::chrono::duration_cast<std::chrono::milliseconds>(answer_by - asked).count());
      continue;
    }
    // Claimed: the handler is unwinding. Bounded too: an unwinder waiting for a lock the interrupted
    // thread holds would otherwise stop the watchdog thread, and with it the progress reports.
    const auto unwound_by = std::min(Clock::now() + d::answer_wait, deadline);
    wait_until(unwound_by);
    if (!s.done.load(std::memory_order_acquire)) {
      stack.failure = fmt::format("its unwinder did not return within {} ms; no further stacks are taken",
                                  std::chrono::duration_cast<std::chrono::milliseconds>(unwound_by - asked).count());
      slot_lost = true;
      not_asked += left;
      break;
    }
    stack.frames.assign(s.frames, s.frames + s.depth);
    s.owner.store(0);
  }
  d::Symboliser symbolise;
  for (const auto& stack : captured) {
    if (!stack.failure.empty()) {
      emit(fmt::format("{}: {}\n\n", stack.header, stack.failure));
      continue;
    }
    // The first two frames are the handler and the kernel's signal trampoline.
    const int depth = static_cast<int>(stack.frames.size());
    emit(stack.header + ":\n" +
         (Clock::now() < deadline ? symbolise(stack.frames.data(), depth, 2)
                                  : d::addresses(stack.frames.data(), depth, 2, "no time left to name them")) +
         "\n");
  }
  if (not_asked) emit(fmt::format("(no time left to ask {} more thread(s) for their stacks)\n", not_asked));
}

// write(2), not std::cerr: stdio's stream lock may be held by the thread a fatal signal stopped.
MESHTORCH_DECL void write_to_stderr(const std::string& text) {
  for (std::size_t written = 0; written < text.size();) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<std::size_t>(n);
  }
}

}  // namespace stack_dump_detail

MESHTORCH_DECL std::string all_thread_stacks(std::chrono::steady_clock::time_point deadline) {
  std::string out;
  stack_dump_detail::emit_thread_stacks(deadline, [&out](const std::string& piece) { out += piece; });
  return out;
}

MESHTORCH_DECL void write_all_thread_stacks(int rank, const std::string& reason,
                                            std::chrono::steady_clock::time_point deadline) {
  namespace d = stack_dump_detail;
  d::write_to_stderr(fmt::format("meshtorch: rank {}: stacks of every thread (pid {}, {}), most recent call last:\n",
                                 rank, ::getpid(), reason));
  d::emit_thread_stacks(deadline, d::write_to_stderr);
  d::write_to_stderr(fmt::format("meshtorch: rank {}: end of stacks\n", rank));
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
