#pragma once
// One thread per core for the parts of a batch (--cpu-batch-split): the caller and its workers
// each run a part's work at once, each with its share of the intra-op threads (one, on a machine
// of as many cores as parts), where one thread running the whole batch would split each kernel
// across the cores.
//
// Why: on a CPU a step is some hundreds of kernels, each split by LibTorch's intra-op threads
// (OpenMP, and MKL's within a GEMM) and joined again. Two threads, each running forward and
// backward on half the batch with its kernels whole, skip those joins and keep each thread's
// operands in its own core's caches. Chapter 1 with 2 threads on a 2-core AMD EPYC, against one
// team of 2 threads over the whole batch: 1.03x the tokens/s at llama-6x384, 1.08x at llama-100m,
// 1.18x at llama-tiny (docs/performance.md). Autograd adds the parts' gradients into the same
// .grad: with two parts a + b, bitwise the same whichever finishes first.
//
// The workers run with the caller's thread-local state at the call (grad mode, autocast, the
// profiler's callbacks: at::ThreadLocalState), so a part runs as the caller's code would.
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ThreadLocalState.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

class CoreWorkers {
 public:
  // `parts` >= 1: parts - 1 worker threads, started now; the caller runs part 0. Each part runs
  // with `threads_per_part` intra-op threads.
  MESHTORCH_DECL CoreWorkers(int parts, int threads_per_part);
  MESHTORCH_DECL ~CoreWorkers();
  CoreWorkers(const CoreWorkers&) = delete;
  CoreWorkers& operator=(const CoreWorkers&) = delete;

  int parts() const { return static_cast<int>(workers_.size()) + 1; }
  int threads_per_part() const { return threads_per_part_; }

  // Runs work(part) for every part in [0, parts()) at once: part 0 on this thread, each other on
  // its worker, inside a profiler scope named `scope` (a training phase, so that the profile
  // counts a worker's ops in it as it counts this thread's), each with threads_per_part()
  // intra-op threads (LibTorch's; this thread's are back to what they were after the call).
  // Returns when every part has returned; then, if any threw, rethrows the exception of the
  // lowest part that did.
  //
  // No timeout: a part is this process's own thread doing the caller's kind of work, and one that
  // fails reports it here; a wait on another process would need one.
  MESHTORCH_DECL void run(const std::function<void(int part)>& work, const char* scope);

 private:
  MESHTORCH_DECL void serve(int part);

  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  const std::function<void(int)>* work_ = nullptr;
  const char* scope_ = nullptr;
  const int threads_per_part_;
  std::optional<at::ThreadLocalState> caller_state_;
  std::uint64_t round_ = 0;  // run() calls so far: a worker serves each once
  int running_ = 0;          // workers still in this round's work
  bool stopping_ = false;
  std::vector<std::exception_ptr> errors_;  // per part, this round
  std::vector<std::thread> workers_;
};

// What the parts of --cpu-batch-split depend on, beside the flag.
struct BatchSplitRun {
  torch::Device device = torch::kCPU;
  int intra_op_threads = 1;
  std::int64_t rows = 1;        // of a micro-batch (-b)
  std::int64_t grad_accum = 1;  // micro-batches a step
  bool deterministic = false;
};

// The parts --cpu-batch-split `flag` asks for: "off" 1; "auto" 2 on a CPU with at least 2
// intra-op threads, rows to split and one micro-batch a step, else 1; a count as given. Autograd
// adds the parts' gradients into .grad in the order the parts finish, which leaves the bits the
// same only for 2 parts into an empty .grad ((a + b) or (b + a); but (g + a) + b differs from
// (g + b) + a): so "auto" never varies them, and with `deterministic` a count above 2, or one
// above 1 with --grad-accum above 1, is a ConfigError, as is a count on another device or above
// the micro-batch's rows (a thread each, none of them with a row to run).
MESHTORCH_DECL int cpu_batch_split_parts(const std::string& flag, const BatchSplitRun& run);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <ATen/record_function.h>
#include <fmt/format.h>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/error.hpp>

namespace meshtorch::train {

MESHTORCH_DECL int cpu_batch_split_parts(const std::string& flag, const BatchSplitRun& run) {
  if (flag == "off") return 1;
  if (flag == "auto")
    return run.device.is_cpu() && run.intra_op_threads >= 2 && run.rows >= 2 && run.grad_accum == 1 ? 2 : 1;
  const auto count = comm::detail::parse_integer(flag);
  if (!count || *count < 1)
    throw ConfigError(fmt::format("--cpu-batch-split: expected auto, off or a count of at least 1, got '{}'", flag));
  if (!run.device.is_cpu())
    throw ConfigError(
        fmt::format("--cpu-batch-split {}: the batch is split across threads on a CPU only; on {} give auto or off",
                    flag, run.device.str()));
  if (*count > run.rows)
    throw ConfigError(fmt::format(
        "--cpu-batch-split {}: more parts than a micro-batch's {} rows (-b), each a thread; give at most {}", flag,
        run.rows, run.rows));
  const bool summed = run.grad_accum > 1;
  if (run.deterministic && (*count > 2 || (*count > 1 && summed)))
    throw ConfigError(
        fmt::format("--cpu-batch-split {} with --deterministic{}: autograd adds the parts' gradients in the order they "
                    "finish, which changes the bits with {}; give {}",
                    flag, summed ? fmt::format(" and --grad-accum {}", run.grad_accum) : "",
                    summed ? "gradients already summed" : "three or more parts", summed ? "off" : "at most 2"));
  return static_cast<int>(*count);
}

MESHTORCH_DECL CoreWorkers::CoreWorkers(int parts, int threads_per_part) : threads_per_part_(threads_per_part) {
  TORCH_CHECK(parts >= 1, "CoreWorkers: parts must be at least 1, got ", parts);
  TORCH_CHECK(threads_per_part >= 1, "CoreWorkers: threads_per_part must be at least 1, got ", threads_per_part);
  errors_.resize(static_cast<std::size_t>(parts));
  workers_.reserve(static_cast<std::size_t>(parts - 1));
  for (int part = 1; part < parts; ++part) workers_.emplace_back([this, part] { serve(part); });
}

MESHTORCH_DECL CoreWorkers::~CoreWorkers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

namespace core_workers_detail {
// A profiler scope as PhaseTimers opens one (a user scope named after the phase); inactive, a check
// of the thread's callbacks, when no profiler runs.
inline void run_in_scope(const char* scope, const std::function<void(int)>& work, int part) {
  at::RecordFunction record(at::RecordScope::USER_SCOPE);
  if (record.isActive()) record.before(scope, c10::ArrayRef<const c10::IValue>{});
  work(part);
}
}  // namespace core_workers_detail

MESHTORCH_DECL void CoreWorkers::run(const std::function<void(int)>& work, const char* scope) {
  const int threads = at::get_num_threads();
  at::set_num_threads(threads_per_part_);
  {
    std::lock_guard lock(mutex_);
    work_ = &work;
    scope_ = scope;
    caller_state_.emplace();
    std::fill(errors_.begin(), errors_.end(), nullptr);
    running_ = static_cast<int>(workers_.size());
    ++round_;
  }
  wake_.notify_all();
  try {
    work(0);  // the caller's own scope (its phase timer's) is already open
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  {
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return running_ == 0; });
    work_ = nullptr;
    caller_state_.reset();
  }
  at::set_num_threads(threads);
  for (const auto& error : errors_)
    if (error) std::rethrow_exception(error);
}

MESHTORCH_DECL void CoreWorkers::serve(int part) {
  std::uint64_t served = 0;
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || round_ != served; });
    if (stopping_) return;
    served = round_;
    const auto* work = work_;
    const char* scope = scope_;
    const auto state = *caller_state_;
    lock.unlock();
    std::exception_ptr error;
    try {
      at::ThreadLocalStateGuard caller(state);
      at::set_num_threads(threads_per_part_);  // this thread's OpenMP team; the caller set MKL's, which is global
      core_workers_detail::run_in_scope(scope, *work, part);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    errors_[static_cast<std::size_t>(part)] = error;
    if (--running_ == 0) finished_.notify_all();
  }
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
