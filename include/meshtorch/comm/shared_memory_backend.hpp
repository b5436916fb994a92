#pragma once
// The collectives of a CPU group whose ranks share one host, through one shared-memory segment
// instead of Gloo's sockets. Gloo moves every message through the kernel's loopback TCP stack
// (a copy into and out of socket buffers, a system call per piece, a thread hop); here a rank
// copies its piece into its slot of the segment once and reads its peers' slots directly:
// docs/performance.md "CPU collectives through shared memory" has what that buys.
//
// It is the default for CPU groups (MESHTORCH_CPU_TRANSPORT=gloo keeps Gloo alone). It serves
// all_reduce (sum, product, max, min), all_gather, reduce_scatter, broadcast and barrier of
// contiguous tensors of the usual numeric dtypes; everything else (send and receive, all_to_all,
// bool or complex tensors) goes to the group's Gloo backend, which it wraps. A group whose ranks
// run on several hosts uses Gloo alone; one whose ranks share a host but cannot all map the
// segment (/dev/shm full or missing) falls back to Gloo on every rank alike, and rank 0 says why.
//
// How the segment is used. Each rank has two slots, used by alternate steps; a collective is one
// step per slot-sized chunk. In step k a rank writes its chunk to slot (k mod 2), then publishes k
// in its own counter, then waits until every peer has published k, then reads their slots. A slot
// is written again two steps later, by which time every peer has published k + 1 and so has
// finished reading step k. Each rank also publishes what its step is (op, dtype, sizes), so ranks
// that issue different collectives are told so at once instead of reading garbage. Reductions
// add the slots in rank order on every rank, so all ranks hold bitwise the same result.
//
// Every wait is bounded by the group's timeout and names the group ranks that did not arrive; a
// peer that has exited (same host, so its pid can be asked) is reported within 100 ms. After a
// failure the group is broken: later collectives fail at once with the first failure's reason,
// and so do the peers' (the failure is written into the segment). The flight recorder names such
// a group "(shm)" for every op, though its sends, receives and all-to-alls ride its Gloo backend.
// The collectives run in order on one thread per group, as Gloo's do, so *_async overlaps them
// with compute and Work::wait keeps its meaning. Those it serves and those Gloo serves are ordered
// apart: wait for a receive before reducing the tensor it fills (the library's code does).
#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

enum class CpuTransport { gloo, shared_memory };

// MESHTORCH_CPU_TRANSPORT: "shm" (or unset) or "gloo"; anything else is a ConfigError.
MESHTORCH_DECL CpuTransport cpu_transport_from_environment();

// A backend that serves the group's CPU collectives through shared memory and hands the rest to
// `fallback`, or nullptr when the group's ranks are on several hosts or cannot all map the segment.
// Every rank of the group calls it at the same point (it meets the others through `store`, already
// prefixed for the group), and all of them get a backend or all get nullptr.
MESHTORCH_DECL c10::intrusive_ptr<c10d::Backend> make_shared_memory_backend(c10::intrusive_ptr<c10d::Store> store,
                                                                            int rank, int size,
                                                                            std::chrono::milliseconds timeout,
                                                                            c10::intrusive_ptr<c10d::Backend> fallback);

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(programs)
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/core/ivalue.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <meshtorch/error.hpp>

namespace meshtorch::comm {

MESHTORCH_DECL CpuTransport cpu_transport_from_environment() {
  const char* choice = std::getenv("MESHTORCH_CPU_TRANSPORT");
  const std::string value = choice && *choice ? choice : "shm";
  if (value == "gloo") return CpuTransport::gloo;
  if (value == "shm") return CpuTransport::shared_memory;
  throw ConfigError(
      fmt::format("MESHTORCH_CPU_TRANSPORT is '{}': expected 'shm' (the default: CPU collectives between the ranks of "
                  "one host through shared memory) or 'gloo' (Gloo's sockets alone)",
                  value));
}

namespace shared_memory {

enum class Op : std::uint32_t { all_reduce = 1, all_gather, reduce_scatter, broadcast, barrier };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce:
      return "all_reduce";
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::broadcast:
      return "broadcast";
    case Op::barrier:
      return "barrier";
  }
  return "an unknown collective";
}

// What a rank says its step is; every rank of a step must say the same.
struct StepDescription {
  std::uint32_t op = 0;
  std::int32_t dtype = -1;
  std::int32_t reduce = -1;
  std::int32_t root = -1;
  std::uint64_t bytes = 0;   // of the whole collective, per rank
  std::uint64_t offset = 0;  // of this chunk in it

  bool operator==(const StepDescription&) const = default;
};

inline std::string describe(const StepDescription& step) {
  std::string out = op_name(static_cast<Op>(step.op));
  if (static_cast<Op>(step.op) == Op::barrier) return out;
  if (step.reduce >= 0)
    out += fmt::format(" ({})", step.reduce == 0   ? "sum"
                                : step.reduce == 1 ? "product"
                                : step.reduce == 2 ? "max"
                                                   : "min");
  if (step.root >= 0) out += fmt::format(" from group rank {}", step.root);
  out += fmt::format(" of {} bytes of {}", step.bytes, c10::toString(static_cast<c10::ScalarType>(step.dtype)));
  return step.offset ? out + fmt::format(" (the chunk at byte {})", step.offset) : out;
}

struct alignas(64) RankState {
  // The last step whose slot this rank has written: the word peers wait on (a futex).
  std::atomic<std::uint32_t> published{0};
  // Set (after `reason`) when this rank's side of the group has failed: its peers then stop
  // waiting for it at once, with its reason, instead of at their timeout.
  std::atomic<std::uint32_t> broken{0};
  StepDescription steps[2];  // by the step's parity, so that a fast rank never overwrites one being read
  char reason[240] = {};
};

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "the step counters are shared between processes");

struct Header {
  std::uint64_t magic = 0;
  std::uint32_t world = 0;
  std::uint64_t slot_bytes = 0;
};

constexpr std::uint64_t kMagic = 0x6d65736874736d31;  // "meshtsm1"

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// The segment's layout: the header, one RankState per rank, then two slots per rank.
struct Layout {
  int world = 0;
  std::size_t slot_bytes = 0;

  std::size_t states_offset() const { return round_up(sizeof(Header), 64); }
  std::size_t slots_offset() const { return round_up(states_offset() + world * sizeof(RankState), 4096); }
  std::size_t total_bytes() const { return slots_offset() + 2 * static_cast<std::size_t>(world) * slot_bytes; }

  // 2 MiB a group (512 KiB slots for a pair of ranks, 128 KiB for eight, more only beyond 8): the
  // pages a rank touches count in its resident set, and the groups of a mesh (19 for 2 x 2 x 2 on
  // 8 ranks) must fit a container's default 64 MiB /dev/shm. Larger slots save only a step's
  // handshake, a few microseconds, per slot of data.
  static std::size_t slot_bytes_for(int world) {
    const std::size_t budget = std::size_t{2} << 20;
    return std::clamp(round_up(budget / (2 * static_cast<std::size_t>(world)), 4096), std::size_t{128} << 10,
                      std::size_t{512} << 10);
  }
};

// A mapped segment; unmapped when destroyed. The name is unlinked as soon as every rank has
// mapped it, so nothing is left in /dev/shm whatever happens to the job later.
class Segment {
 public:
  Segment(void* base, Layout layout) : base_(static_cast<std::byte*>(base)), layout_(layout) {}
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() { ::munmap(base_, layout_.total_bytes()); }

  Header& header() { return *reinterpret_cast<Header*>(base_); }
  RankState& state(int rank) { return reinterpret_cast<RankState*>(base_ + layout_.states_offset())[rank]; }
  std::byte* slot(std::uint32_t step, int rank) {
    const std::size_t index = (step & 1u) * static_cast<std::size_t>(layout_.world) + static_cast<std::size_t>(rank);
    return base_ + layout_.slots_offset() + index * layout_.slot_bytes;
  }
  const Layout& layout() const { return layout_; }

 private:
  std::byte* base_;
  Layout layout_;
};

// Waiting on a counter another process writes. Written by hand because std::atomic::wait has no
// timeout, and libstdc++ waits on private futexes, which a peer process's notify never reaches.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t seen, std::chrono::nanoseconds timeout) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec limit{static_cast<time_t>(seconds.count()), static_cast<long>((timeout - seconds).count())};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, seen, &limit, nullptr, 0);
}

inline void futex_wake_all(std::atomic<std::uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Whether counter value `published` has reached step `step` (counters wrap after 2^32 steps).
inline bool reached(std::uint32_t published, std::uint32_t step) {
  return static_cast<std::int32_t>(published - step) >= 0;
}

// out[i] = a[i] (op) b[i], in T's arithmetic (bf16 and fp16 compute in float and round, as
// their operators do). Plain loops: the compiler vectorises them, and they keep ATen's thread
// pool out of the transport's thread.
template <class T>
void combine(T* out, const T* a, const T* b, std::size_t n, c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] + b[i]);
      break;
    case c10d::ReduceOp::PRODUCT:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] * b[i]);
      break;
    case c10d::ReduceOp::MAX:
      for (std::size_t i = 0; i < n; ++i) out[i] = a[i] < b[i] ? b[i] : a[i];
      break;
    case c10d::ReduceOp::MIN:
      for (std::size_t i = 0; i < n; ++i) out[i] = b[i] < a[i] ? b[i] : a[i];
      break;
    default:
      throw std::logic_error("shared-memory transport: a reduction it does not serve was let through");
  }
}

// memcpy, which may not be given a null pointer even for no bytes (an empty tensor has one), nor
// overlapping ranges.
// A piece gathered into the tensor it came from is already in place.
inline void copy_bytes(void* to, const void* from, std::size_t bytes) {
  if (bytes && to != from) std::memcpy(to, from, bytes);
}

inline bool serves(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kBFloat16:
    case c10::kHalf:
    case c10::kChar:
    case c10::kByte:
    case c10::kShort:
    case c10::kInt:
    case c10::kLong:
      return true;
    default:
      return false;
  }
}

inline bool serves(c10d::ReduceOp::RedOpType op) {
  return op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::PRODUCT || op == c10d::ReduceOp::MAX ||
         op == c10d::ReduceOp::MIN;
}

inline int reduce_code(c10d::ReduceOp::RedOpType op) {
  return op == c10d::ReduceOp::SUM ? 0 : op == c10d::ReduceOp::PRODUCT ? 1 : op == c10d::ReduceOp::MAX ? 2 : 3;
}

// out = sources[0] (op) sources[1] (op) ..., in that order.
inline void reduce_into(std::byte* out, const std::vector<const std::byte*>& sources, std::size_t bytes,
                        c10::ScalarType dtype, c10d::ReduceOp::RedOpType op) {
  // ATen's dispatch over exactly the dtypes serves() admits.
  AT_DISPATCH_ALL_TYPES_AND2(c10::kBFloat16, c10::kHalf, dtype, "shared-memory reduction", [&] {
    const std::size_t n = bytes / sizeof(scalar_t);
    auto* target = reinterpret_cast<scalar_t*>(out);
    combine(target, reinterpret_cast<const scalar_t*>(sources[0]), reinterpret_cast<const scalar_t*>(sources[1]), n,
            op);
    for (std::size_t s = 2; s < sources.size(); ++s)
      combine(target, target, reinterpret_cast<const scalar_t*>(sources[s]), n, op);
  });
}

// Whether process `pid` is still running: not gone, and not a zombie its parent has yet to reap.
inline bool process_alive(int pid) {
  if (::kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc to ask: kill's answer stands
  const auto name_end = line.rfind(')');
  return name_end == std::string::npos || name_end + 2 >= line.size() ||
         (line[name_end + 2] != 'Z' && line[name_end + 2] != 'X');
}

// A collective in the transport's queue: done (or failed) when its thread has run it.
class SharedMemoryWork final : public c10d::Work {
 public:
  SharedMemoryWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                   std::function<std::string()> waiting_for)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())),
        waiting_for_(std::move(waiting_for)) {}

  // The future first, as Gloo does, so that a thread woken by wait() finds it completed. A
  // callback on the future that throws fails the wait with its error.
  void complete() {
    try {
      future_->markCompleted(c10::IValue(outputs_));
    } catch (...) {
      finish(std::current_exception());
      return;
    }
    finish();
  }

  void fail(std::exception_ptr error) {
    try {
      future_->setError(error);
    } catch (...) {
      // A callback that throws on the error path: the collective's own error is the one to report.
    }
    finish(error);
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    if (timeout == kNoTimeout) cv_.wait(lock, [&] { return completed_; });
    // The transport's thread counts the same timeout from the issue, so it fails the collective
    // (and tells the peers) by then: its verdict is awaited a moment longer, so that no peer
    // completes a collective this rank has already given up on.
    else if (!cv_.wait_for(lock, timeout, [&] { return completed_; }) &&
             !cv_.wait_for(lock, std::chrono::seconds(1), [&] { return completed_; }))
      throw std::runtime_error(fmt::format("timed out after {} ms: {}", timeout.count(), waiting_for_()));
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::function<std::string()> waiting_for_;
};

class SharedMemoryBackend final : public c10d::Backend {
 public:
  SharedMemoryBackend(int rank, int size, std::chrono::milliseconds timeout, std::unique_ptr<Segment> segment,
                      c10::intrusive_ptr<c10d::Backend> fallback, std::vector<int> peer_pids)
      : c10d::Backend(rank, size),
        timeout_(timeout.count()),
        segment_(std::move(segment)),
        fallback_(std::move(fallback)),
        peer_pids_(std::move(peer_pids)),
        status_(std::make_shared<Status>()) {
    worker_ = std::thread([this] { serve(); });
  }

  ~SharedMemoryBackend() override {
    {
      std::lock_guard lock(queue_mutex_);
      stopping_ = true;
    }
    stopping_flag_.store(true);
    queue_ready_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  const std::string getBackendName() const override { return "shm"; }

  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout.count();
    fallback_->setTimeout(timeout);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& options) override {
    if (tensors.size() != 1 || !serves(tensors[0]) || !serves(options.reduceOp.op_))
      return fallback_->allreduce(tensors, options);
    at::Tensor tensor = tensors[0];
    const auto op = options.reduceOp.op_;
    return enqueue(c10d::OpType::ALLREDUCE, {tensor}, options.timeout, [this, tensor, op](const Deadline& deadline) {
      auto* data = static_cast<std::byte*>(tensor.data_ptr());
      in_steps(
          Op::all_reduce, tensor, reduce_code(op), -1, 1, deadline,
          [&](std::byte* slot, std::size_t offset, std::size_t length, std::size_t) {
            copy_bytes(slot, data + offset, length);
          },
          [&](std::uint32_t k, std::size_t offset, std::size_t length, std::size_t) {
            reduce_into(data + offset, slots(k, 0), length, tensor.scalar_type(), op);
          });
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& options) override {
    if (inputs.size() != 1 || outputs.size() != 1 || !serves(inputs[0], outputs[0]))
      return fallback_->allgather(outputs, inputs, options);
    at::Tensor input = inputs[0];
    std::vector<at::Tensor> pieces = outputs[0];
    check_pieces("all_gather", input, pieces);
    return enqueue(c10d::OpType::ALLGATHER, pieces, options.timeout, [this, input, pieces](const Deadline& deadline) {
      const auto* data = static_cast<const std::byte*>(input.data_ptr());
      in_steps(
          Op::all_gather, input, -1, -1, 1, deadline,
          [&](std::byte* slot, std::size_t offset, std::size_t length, std::size_t) {
            copy_bytes(slot, data + offset, length);
          },
          [&](std::uint32_t k, std::size_t offset, std::size_t length, std::size_t) {
            for (int r = 0; r < size_; ++r)
              copy_bytes(static_cast<std::byte*>(pieces[r].data_ptr()) + offset,
                         r == rank_ ? data + offset : segment_->slot(k, r), length);
          });
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& options) override {
    if (outputs.size() != 1 || inputs.size() != 1 || !serves(outputs[0], inputs[0]) || !serves(options.reduceOp.op_))
      return fallback_->reduce_scatter(outputs, inputs, options);
    at::Tensor output = outputs[0];
    std::vector<at::Tensor> pieces = inputs[0];
    check_pieces("reduce_scatter", output, pieces);
    const auto op = options.reduceOp.op_;
    return enqueue(
        c10d::OpType::REDUCE_SCATTER, {output}, options.timeout, [this, output, pieces, op](const Deadline& deadline) {
          auto* data = static_cast<std::byte*>(output.data_ptr());
          // Each step carries the same chunk of every piece: piece j's part at j * chunk.
          in_steps(
              Op::reduce_scatter, output, reduce_code(op), -1, size_, deadline,
              [&](std::byte* slot, std::size_t offset, std::size_t length, std::size_t chunk) {
                for (int j = 0; j < size_; ++j)
                  copy_bytes(slot + j * chunk, static_cast<const std::byte*>(pieces[j].data_ptr()) + offset, length);
              },
              [&](std::uint32_t k, std::size_t offset, std::size_t length, std::size_t chunk) {
                reduce_into(data + offset, slots(k, rank_ * chunk), length, output.scalar_type(), op);
              });
        });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& options) override {
    if (tensors.size() != 1 || options.rootTensor != 0 || !serves(tensors[0]))
      return fallback_->broadcast(tensors, options);
    at::Tensor tensor = tensors[0];
    const int root = static_cast<int>(options.rootRank);
    if (root < 0 || root >= size_)
      throw std::invalid_argument(
          fmt::format("broadcast from group rank {}, which is not a rank of the group (0 to {})", root, size_ - 1));
    return enqueue(c10d::OpType::BROADCAST, {tensor}, options.timeout, [this, tensor, root](const Deadline& deadline) {
      auto* data = static_cast<std::byte*>(tensor.data_ptr());
      in_steps(
          Op::broadcast, tensor, -1, root, 1, deadline,
          [&](std::byte* slot, std::size_t offset, std::size_t length, std::size_t) {
            if (rank_ == root) copy_bytes(slot, data + offset, length);
          },
          [&](std::uint32_t k, std::size_t offset, std::size_t length, std::size_t) {
            if (rank_ != root) copy_bytes(data + offset, segment_->slot(k, root), length);
          });
    });
  }

  // Ordered after this group's earlier collectives, which run on the same thread.
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& options) override {
    return enqueue(c10d::OpType::BARRIER, {}, options.timeout, [this](const Deadline& deadline) {
      const StepDescription step{static_cast<std::uint32_t>(Op::barrier), -1, -1, -1, 0, 0};
      exchange(next_step(), step, deadline);
    });
  }

  // Everything else is Gloo's.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& options) override {
    return fallback_->allreduce_coalesced(tensors, options);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& options) override {
    return fallback_->reduce(tensors, options);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& options) override {
    return fallback_->_allgather_base(output, input, options);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& options) override {
    return fallback_->allgather_coalesced(outputs, inputs, options);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& options) override {
    return fallback_->allgather_into_tensor_coalesced(outputs, inputs, options);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& options) override {
    return fallback_->gather(outputs, inputs, options);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& options) override {
    return fallback_->scatter(outputs, inputs, options);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& options) override {
    return fallback_->_reduce_scatter_base(output, input, options);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& options) override {
    return fallback_->reduce_scatter_tensor_coalesced(outputs, inputs, options);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& options) override {
    return fallback_->alltoall_base(output, input, output_splits, input_splits, options);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& options) override {
    return fallback_->alltoall(outputs, inputs, options);
  }
  void monitoredBarrier(const c10d::BarrierOptions& options, bool wait_all_ranks) override {
    fallback_->monitoredBarrier(options, wait_all_ranks);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int destination, int tag) override {
    return fallback_->send(tensors, destination, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int source, int tag) override {
    return fallback_->recv(tensors, source, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return fallback_->recvAnysource(tensors, tag);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& options) override {
    return fallback_->allreduce_sparse(tensors, options);
  }
  void setSequenceNumberForGroup() override { fallback_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return fallback_->getSequenceNumberForGroup(); }

 private:
  struct Deadline {
    std::chrono::steady_clock::time_point at;
    std::chrono::milliseconds timeout;  // that set it, for the message
  };

  // What the thread is doing, for a wait that times out; the first failure, which breaks the group.
  struct Status {
    std::mutex mutex;
    std::string waiting;
    std::string broken;
  };

  struct Task {
    c10::intrusive_ptr<SharedMemoryWork> work;
    std::function<void(const Deadline&)> body;
    Deadline deadline;  // counted from the issue, as the caller's wait is
  };

  std::size_t chunk_bytes(std::size_t element_size, int parts) const {
    const std::size_t per_part = segment_->layout().slot_bytes / static_cast<std::size_t>(parts);
    const std::size_t chunk = per_part / element_size * element_size;
    if (chunk == 0)
      throw std::logic_error(fmt::format("a slot of {} bytes cannot carry {} parts of {}-byte elements",
                                         segment_->layout().slot_bytes, parts, element_size));
    return chunk;
  }

  // Calls body(offset, length) for each chunk; once with length 0 for an empty tensor, so that
  // every rank takes the same steps.
  template <class Body>
  static void for_each_chunk(std::size_t bytes, std::size_t chunk, Body&& body) {
    if (bytes == 0) return body(std::size_t{0}, std::size_t{0});
    for (std::size_t offset = 0; offset < bytes; offset += chunk) body(offset, std::min(chunk, bytes - offset));
  }

  std::uint32_t next_step() { return ++step_; }

  // A collective of `tensor`'s bytes in slot-sized steps, each cut in `parts` (reduce-scatter's
  // pieces): for each chunk, write(slot, offset, length, chunk) fills this rank's slot, the ranks
  // meet, and read(step, offset, length, chunk) takes what this rank needs from theirs.
  template <class Write, class Read>
  void in_steps(Op op, const at::Tensor& tensor, int reduce, int root, int parts, const Deadline& deadline,
                Write&& write, Read&& read) {
    const std::size_t bytes = tensor.nbytes();
    const std::size_t chunk = chunk_bytes(tensor.element_size(), parts);
    StepDescription step{
        static_cast<std::uint32_t>(op), static_cast<int>(tensor.scalar_type()), reduce, root, bytes, 0};
    for_each_chunk(bytes, chunk, [&](std::size_t offset, std::size_t length) {
      step.offset = offset;
      const std::uint32_t k = next_step();
      write(segment_->slot(k, rank_), offset, length, chunk);
      exchange(k, step, deadline);
      read(k, offset, length, chunk);
    });
  }

  // Every rank's slot of step k, from byte `at` on, in rank order (the order of every reduction).
  std::vector<const std::byte*> slots(std::uint32_t k, std::size_t at) {
    std::vector<const std::byte*> out;
    for (int r = 0; r < size_; ++r) out.push_back(segment_->slot(k, r) + at);
    return out;
  }

  // Dense contiguous CPU tensors of a dtype it adds: what it serves; Gloo gets the rest. Ranks that
  // issue the same collective pass the same kinds of tensors, so they all take the same path.
  static bool serves(const at::Tensor& tensor) {
    return tensor.layout() == c10::kStrided && tensor.device().is_cpu() && tensor.is_contiguous() &&
           shared_memory::serves(tensor.scalar_type());
  }

  static bool serves(const at::Tensor& tensor, const std::vector<at::Tensor>& pieces) {
    return serves(tensor) && std::all_of(pieces.begin(), pieces.end(), [](const at::Tensor& t) { return serves(t); });
  }

  static bool serves(c10d::ReduceOp::RedOpType op) { return shared_memory::serves(op); }

  void check_pieces(const char* collective, const at::Tensor& tensor, const std::vector<at::Tensor>& pieces) const {
    if (static_cast<int>(pieces.size()) != size_)
      throw std::invalid_argument(fmt::format("{} takes one piece per group rank: {} pieces for a group of {}",
                                              collective, pieces.size(), size_));
    for (const auto& piece : pieces)
      if (piece.numel() != tensor.numel() || piece.scalar_type() != tensor.scalar_type())
        throw std::invalid_argument(fmt::format(
            "{}: every piece must have the {} elements of {} of the tensor, not {} of {}", collective, tensor.numel(),
            c10::toString(tensor.scalar_type()), piece.numel(), c10::toString(piece.scalar_type())));
  }

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds timeout, std::function<void(const Deadline&)> body) {
    auto work = c10::make_intrusive<SharedMemoryWork>(rank_, type, std::move(outputs), [status = status_] {
      std::lock_guard lock(status->mutex);
      if (!status->broken.empty()) return status->broken;
      return status->waiting.empty()
                 ? std::string("the group's thread had not finished it (it runs the group's collectives in order)")
                 : status->waiting;
    });
    {
      std::lock_guard lock(queue_mutex_);
      const auto limit = timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeout_.load()) : timeout;
      queue_.push_back({work, std::move(body), Deadline{std::chrono::steady_clock::now() + limit, limit}});
    }
    queue_ready_.notify_one();
    return work;
  }

  void serve() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(queue_mutex_);
        queue_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::string broken;
      {
        std::lock_guard lock(status_->mutex);
        broken = status_->broken;
      }
      if (!broken.empty()) {
        task.work->fail(std::make_exception_ptr(std::runtime_error(broken)));
        continue;
      }
      try {
        task.body(task.deadline);
        task.work->complete();
      } catch (const std::exception& e) {
        {
          std::lock_guard lock(status_->mutex);
          status_->broken =
              fmt::format("the shared-memory group is broken since an earlier collective failed: {}", e.what());
        }
        tell_peers(e.what());
        task.work->fail(std::current_exception());
      }
    }
  }

  // Publishes step k as described, waits until every peer has published it, and checks that they
  // describe it alike.
  void exchange(std::uint32_t k, const StepDescription& step, const Deadline& deadline) {
    RankState& me = segment_->state(rank_);
    me.steps[k & 1u] = step;
    me.published.store(k, std::memory_order_release);
    futex_wake_all(me.published);
    for (int r = 0; r < size_; ++r)
      if (r != rank_) wait_for(r, k, step, deadline);
    // A peer that published this step and then gave up waiting has already failed it: fail it here too.
    for (int r = 0; r < size_; ++r)
      if (r != rank_) throw_if_gave_up(r, k, step);
    for (int r = 0; r < size_; ++r) {
      const StepDescription& theirs = segment_->state(r).steps[k & 1u];
      if (!(theirs == step))
        throw std::runtime_error(
            fmt::format("the ranks issued different collectives (a collective mismatch): "
                        "group rank {} is in {}, group rank {} in {}",
                        rank_, describe(step), r, describe(theirs)));
    }
  }

  void wait_for(int peer, std::uint32_t k, const StepDescription& step, const Deadline& deadline) {
    std::atomic<std::uint32_t>& word = segment_->state(peer).published;
    // Peers usually arrive within microseconds: spin briefly before sleeping.
    for (int spin = 0; spin < 2000; ++spin) {
      if (reached(word.load(std::memory_order_acquire), k)) return;
      cpu_relax();
    }
    {
      std::lock_guard lock(status_->mutex);
      status_->waiting = fmt::format("group rank {} waits in {} for group ranks {} that did not arrive", rank_,
                                     describe(step), missing(k));
    }
    auto next_liveness_check = std::chrono::steady_clock::now();
    for (;;) {
      const std::uint32_t seen = word.load(std::memory_order_acquire);
      if (reached(seen, k)) break;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline.at)
        throw std::runtime_error(
            fmt::format("timed out after {} ms: group rank {} waits in {} for group ranks {} "
                        "that did not arrive",
                        deadline.timeout.count(), rank_, describe(step), missing(k)));
      if (stopping_flag_.load(std::memory_order_relaxed))
        throw std::runtime_error(
            fmt::format("the group was destroyed while group rank {} waited in {}", rank_, describe(step)));
      throw_if_gave_up(peer, k, step);
      if (now >= next_liveness_check) {
        // Asked after the counter: a peer that published and then exited (the job's end) has arrived.
        if (!peer_alive(peer) && !reached(word.load(std::memory_order_acquire), k))
          throw std::runtime_error(
              fmt::format("group rank {} (pid {}) has exited while group rank {} waits for it in {}", peer,
                          peer_pids_[static_cast<std::size_t>(peer)], rank_, describe(step)));
        next_liveness_check = now + std::chrono::milliseconds(100);
      }
      futex_wait(word, seen, std::min<std::chrono::nanoseconds>(deadline.at - now, std::chrono::milliseconds(20)));
    }
    std::lock_guard lock(status_->mutex);
    status_->waiting.clear();
  }

  std::string missing(std::uint32_t k) {
    std::vector<int> ranks;
    for (int r = 0; r < size_; ++r)
      if (!reached(segment_->state(r).published.load(std::memory_order_acquire), k)) ranks.push_back(r);
    return fmt::format("[{}]", fmt::join(ranks, ", "));
  }

  // A peer that failed before it published step k + 1 never finished step k.
  void throw_if_gave_up(int peer, std::uint32_t k, const StepDescription& step) {
    const RankState& theirs = segment_->state(peer);
    if (theirs.broken.load(std::memory_order_acquire) &&
        !reached(theirs.published.load(std::memory_order_acquire), k + 1))
      throw std::runtime_error(
          fmt::format("group rank {} gave up on the group while group rank {} waited for it in {}: {}", peer, rank_,
                      describe(step), std::string(theirs.reason, strnlen(theirs.reason, sizeof(theirs.reason)))));
  }

  // Whether a peer's process still runs (true where its pid cannot be asked): once it has ended,
  // nothing will publish its steps again.
  bool peer_alive(int peer) const {
    const int pid = peer_pids_.empty() ? 0 : peer_pids_[static_cast<std::size_t>(peer)];
    return pid <= 0 || process_alive(pid);
  }

  // Marks this rank's side of the group failed in the segment and wakes whoever waits for it.
  void tell_peers(const std::string& reason) {
    RankState& me = segment_->state(rank_);
    const std::size_t n = std::min(reason.size(), sizeof(me.reason) - 1);
    std::memcpy(me.reason, reason.data(), n);
    me.reason[n] = '\0';
    me.broken.store(1, std::memory_order_release);
    futex_wake_all(me.published);
  }

  std::atomic<std::int64_t> timeout_;  // ms; setTimeout may come from another thread
  std::unique_ptr<Segment> segment_;
  c10::intrusive_ptr<c10d::Backend> fallback_;
  std::vector<int> peer_pids_;  // empty when the ranks do not share a pid namespace
  std::shared_ptr<Status> status_;
  std::uint32_t step_ = 0;  // the worker's only

  std::mutex queue_mutex_;
  std::condition_variable queue_ready_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::atomic<bool> stopping_flag_{false};  // read by a wait in progress
  std::thread worker_;
};

// This host, as its ranks see it: the name and the kernel's boot id (containers may share a name).
inline std::string host_identity() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return {};
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  return std::string(name) + " " + boot_id;
}

// Removes the segments of creators that died during their handshake (killed between creating the
// name and unlinking it), which nothing else would ever remove.
// Tidying only: a folder that cannot be read leaves them, and the group is made all the same.
inline void remove_orphaned_segments() {
  try {
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("meshtorch-", 0) != 0) continue;
      const int pid = std::atoi(name.c_str() + std::strlen("meshtorch-"));
      if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) ::shm_unlink(("/" + name).c_str());
    }
  } catch (const std::filesystem::filesystem_error&) {
  }
}

inline std::string pid_namespace() {
  std::error_code error;
  const auto target = std::filesystem::read_symlink("/proc/self/ns/pid", error);
  return error ? std::string() : target.string();
}

}  // namespace shared_memory

MESHTORCH_DECL c10::intrusive_ptr<c10d::Backend> make_shared_memory_backend(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
    c10::intrusive_ptr<c10d::Backend> fallback) {
  using namespace shared_memory;
  if (size < 2) return nullptr;
  // Ranks on several hosts: Gloo's sockets, without a word (that is what they are for).
  const std::string host = host_identity();
  store->set(fmt::format("shm/host/{}", rank), host);
  for (int r = 0; r < size; ++r) {
    const auto theirs = store->get(fmt::format("shm/host/{}", r));
    if (host.empty() || std::string(theirs.begin(), theirs.end()) != host) return nullptr;
  }
  const Layout layout{size, Layout::slot_bytes_for(size)};
  const auto bytes = layout.total_bytes();
  std::string problem;
  std::unique_ptr<Segment> segment;  // owns the mapping from the moment it exists
  auto map = [&](int fd) {
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
      problem = fmt::format("mmap of {} bytes failed: {}", bytes, std::strerror(errno));
    else
      segment = std::make_unique<Segment>(base, layout);
  };
  // Rank 0 removes the name once every rank has mapped the segment or given up, and on any way out
  // of this function (a peer that dies during the handshake makes the store throw).
  struct Unlink {
    std::string name;
    ~Unlink() {
      if (!name.empty()) ::shm_unlink(name.c_str());
    }
  } unlink;
  if (rank == 0) {
    remove_orphaned_segments();
    std::random_device entropy;
    const std::string name = fmt::format("/meshtorch-{}-{:08x}{:08x}", ::getpid(), entropy(), entropy());
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      problem = fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
    } else {
      unlink.name = name;
      // Reserving the pages now turns a full /dev/shm into this error rather than a SIGBUS later.
      if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0)
        problem = fmt::format("reserving {} bytes in /dev/shm failed: {}", bytes, std::strerror(error));
      else
        map(fd);
      ::close(fd);
    }
    if (segment) {
      Header& header = *new (&segment->header()) Header{};
      header.world = static_cast<std::uint32_t>(size);
      header.slot_bytes = layout.slot_bytes;
      for (int r = 0; r < size; ++r) new (&segment->state(r)) RankState{};
      std::atomic_thread_fence(std::memory_order_release);
      header.magic = kMagic;
    }
    store->set("shm/segment", problem.empty() ? name : std::string());
  } else {
    const auto value = store->get("shm/segment");
    const std::string name(value.begin(), value.end());
    if (name.empty()) {
      problem = "group rank 0 could not create the segment";
    } else if (const int fd = ::shm_open(name.c_str(), O_RDWR, 0600); fd < 0) {
      problem = fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
    } else {
      struct stat info {};
      if (::fstat(fd, &info) != 0 || static_cast<std::size_t>(info.st_size) != bytes)
        problem = fmt::format("the segment {} is not the {} bytes expected", name, bytes);
      else
        map(fd);
      ::close(fd);
      if (segment &&
          (segment->header().magic != kMagic || segment->header().world != static_cast<std::uint32_t>(size) ||
           segment->header().slot_bytes != layout.slot_bytes))
        problem = fmt::format("the segment {} is not laid out for this group of {}", name, size);
    }
  }
  // Every rank says whether it mapped the segment, with its pid and pid namespace.
  store->set(fmt::format("shm/ready/{}", rank),
             problem.empty() ? fmt::format("ok {} {}", ::getpid(), pid_namespace()) : "failed " + problem);
  std::vector<int> pids(static_cast<std::size_t>(size), 0);
  std::string first_problem = problem.empty() ? "" : fmt::format("group rank {}: {}", rank, problem);
  bool one_namespace = true;
  const std::string mine = pid_namespace();
  for (int r = 0; r < size; ++r) {
    const auto value = store->get(fmt::format("shm/ready/{}", r));
    const std::string text(value.begin(), value.end());
    if (text.rfind("ok ", 0) == 0) {
      const auto space = text.find(' ', 3);
      pids[static_cast<std::size_t>(r)] = std::atoi(text.substr(3, space - 3).c_str());
      if (space == std::string::npos || mine.empty() || text.substr(space + 1) != mine) one_namespace = false;
    } else if (first_problem.empty()) {
      first_problem = fmt::format("group rank {}: {}", r, text.substr(std::min<std::size_t>(text.size(), 7)));
    }
  }
  if (!first_problem.empty()) {
    if (rank == 0)
      fmt::print(stderr, "meshtorch: a group of {} ranks on this host uses Gloo's sockets, not shared memory: {}\n",
                 size, first_problem);
    return nullptr;
  }
  if (!one_namespace) pids.clear();  // their pids mean nothing here: no exit check
  return c10::make_intrusive<SharedMemoryBackend>(rank, size, timeout, std::move(segment), std::move(fallback),
                                                  std::move(pids));
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(programs)
