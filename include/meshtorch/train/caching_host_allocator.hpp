#pragma once
// LibTorch's CPU allocator with a cache for large blocks, as CUDA's caching allocator keeps device
// blocks: a freed block of at least 1 MiB is kept and handed out again for a request of its size
// or of down to half of it (the smallest such block; CUDA's serves a request from part of a larger
// block). A training step allocates the same sizes at every step (a layer's gathered weights, the
// reduce-scatter buffers, gradients, activations), so after the first step they come from the cache.
//
// Large blocks are mapped from the kernel and unmapped when given back, not taken from glibc: its
// heap serves blocks of 1-32 MB once its dynamic mmap threshold has grown past them, and a heap
// whose blocks come and go fragments (chapter 7 at llama-100m held 1.16 GB per rank after 6 steps
// where its tensors never exceed 0.75 GB). So the resident large blocks are at most
// reserved_bytes() (rounded up to pages): those in tensors and those cached.
//
// What is cached is bounded by what the process has needed: a block the cache cannot serve is
// made new, and first the blocks cached longest are given back while the large blocks held would
// exceed the most ever in tensors at once and an eighth of it. The cache thus holds another
// phase's blocks while fewer are in use (backward's through the start of forward). Measured at
// llama-100m, 2 threads: chapter 1 makes none of a step's 352 blocks anew (100 with exact sizes
// and no eighth, which cost 64k page faults a step and left it 9% slower than glibc's heap; now
// level with it at 2.10 against 2.18 GB), chapter 4 (2 ranks) 1.36-1.39 GB per rank, flat (1.16-1.20
// without the eighth; 2.1 growing to 3.1 GB when each new block made the cache give back as many
// bytes, over glibc's heap).
//
// Small blocks go straight to c10's allocation functions, as LibTorch's default allocator does.
// launch() and chapter 1 install it on CPU runs; MESHTORCH_HOST_ALLOCATOR=default keeps LibTorch's own.
#include <algorithm>
#include <cstddef>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

class CachingHostAllocator final : public c10::Allocator {
 public:
  // Blocks of this size or more are cached; smaller ones are malloc's business (its bins reuse them well).
  static constexpr std::size_t min_cached_bytes = std::size_t{1} << 20;
  // A freed block that would take the cache past this is given back instead.
  static constexpr std::size_t max_cached_bytes = std::size_t{1} << 30;
  // A cached block serves a request of at least 1/max_oversize of its size (the smallest such
  // block), as CUDA's allocator serves a request from part of a larger cached block.
  static constexpr std::size_t max_oversize = 2;
  // What the cache may hold, with the blocks in tensors, beyond the most there have been in
  // tensors at once: an eighth of that peak. Without it a step whose sizes fit the peak only
  // exactly made blocks anew every step (chapter 1 at llama-100m: 100 of 352 a step, 64k page
  // faults, 9% slower than glibc's heap); with it none or a few.
  static constexpr std::size_t headroom_divisor = 8;

  // The process's allocator: blocks it hands out may be freed at any time up to exit, so it is
  // never destroyed.
  MESHTORCH_DECL static CachingHostAllocator& instance();

  // Makes it the allocator of every CPU tensor allocated from now on (earlier ones keep theirs).
  MESHTORCH_DECL static void install();

  MESHTORCH_DECL c10::DataPtr allocate(std::size_t nbytes) override;

  c10::DeleterFnPtr raw_deleter() const override { return &CachingHostAllocator::release; }

  void copy_data(void* destination, const void* source, std::size_t count) const override {
    default_copy_data(destination, source, count);
  }

  // Bytes held for reuse now, and bytes of every large block made and not given back (in
  // tensors or cached: CUDA's memory_reserved, for large blocks).
  std::size_t cached_bytes() const {
    std::lock_guard lock(mutex_);
    return cached_bytes_;
  }
  std::size_t reserved_bytes() const {
    std::lock_guard lock(mutex_);
    return live_bytes_ + cached_bytes_;
  }

  // Allocations of min_cached_bytes or more since reset_stats(), and how many the cache served.
  struct Stats {
    std::size_t large_allocations = 0;
    std::size_t served_from_cache = 0;
  };
  Stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  void reset_stats() {
    std::lock_guard lock(mutex_);
    stats_ = {};
  }

  // The most bytes of large blocks in tensors at once (since the last release_cached()).
  std::size_t peak_live_bytes() const {
    std::lock_guard lock(mutex_);
    return peak_live_bytes_;
  }

  // Gives every cached block back to the system; the peak that bounds the cache starts again
  // from the blocks in tensors now (for a caller whose phase with a peak that will not recur,
  // such as a load, is over).
  MESHTORCH_DECL void release_cached();

 private:
  CachingHostAllocator() = default;

  using Blocks = std::vector<std::pair<std::size_t, void*>>;  // (size, address), to unmap outside the lock

  // The smallest cached block of nbytes to max_oversize x nbytes, now in a tensor; nullptr if there is none.
  MESHTORCH_DECL void* take_cached(std::size_t nbytes);
  // A new block: first gives back the cached blocks that holding it would take past the bound.
  MESHTORCH_DECL void* make_block(std::size_t nbytes);
  // Before a block of `wanted` bytes is made: the cached blocks to give back, oldest first, so
  // that the large blocks held stay within bound_locked().
  MESHTORCH_DECL Blocks evict_locked(std::size_t wanted);
  // The most bytes of large blocks held, in tensors and cached, before the cache gives some back:
  // the peak in tensors and headroom_divisor's share of it.
  std::size_t bound_locked() const { return peak_live_bytes_ + peak_live_bytes_ / headroom_divisor; }
  // Records a block as handed out to a tensor (may throw before changing anything).
  MESHTORCH_DECL void in_tensor_locked(void* data, std::size_t nbytes);
  // Every cached block, taken out of the cache.
  MESHTORCH_DECL Blocks take_all_cached_locked();

  MESHTORCH_DECL static void release(void* data);

  mutable std::mutex mutex_;
  std::unordered_map<void*, std::size_t> live_;      // large blocks in tensors, by address
  std::map<std::size_t, std::vector<void*>> free_;   // cached blocks, by size (none empty)
  std::deque<std::pair<std::size_t, void*>> order_;  // cached blocks, oldest first
  std::size_t cached_bytes_ = 0;
  std::size_t live_bytes_ = 0;       // large blocks in tensors now
  std::size_t pending_bytes_ = 0;    // large blocks being made now (by other threads too)
  std::size_t peak_live_bytes_ = 0;  // the most there have been in tensors at once
  Stats stats_;
};

// launch()'s choice for CPU runs: the caching allocator unless MESHTORCH_HOST_ALLOCATOR says
// `default` (LibTorch's own, e.g. to measure with jemalloc preloaded). Returns which is in use.
MESHTORCH_DECL std::string use_host_allocator_from_environment();

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::train {

namespace host_allocator_detail {

// A large block straight from the kernel (page-aligned, so also c10's 64-byte alignment): given
// back with unmap_block, its pages return to the system at once.
inline void* map_block(std::size_t nbytes) {
  void* data = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED)
    C10_THROW_ERROR(OutOfMemoryError,
                    fmt::format("CachingHostAllocator: could not map a block of {} bytes: {} (out of memory, or of "
                                "the process's mappings: see vm.max_map_count)",
                                nbytes, std::strerror(errno)));
  return data;
}

inline void unmap_block(void* data, std::size_t nbytes) { ::munmap(data, nbytes); }

}  // namespace host_allocator_detail

MESHTORCH_DECL CachingHostAllocator& CachingHostAllocator::instance() {
  static auto* allocator = new CachingHostAllocator();
  return *allocator;
}

MESHTORCH_DECL void CachingHostAllocator::install() { c10::SetCPUAllocator(&instance(), /*priority=*/1); }

MESHTORCH_DECL c10::DataPtr CachingHostAllocator::allocate(std::size_t nbytes) {
  void* data = nullptr;
  if (nbytes >= min_cached_bytes) {
    data = take_cached(nbytes);
    if (!data) data = make_block(nbytes);
  } else if (nbytes > 0) {
    data = c10::alloc_cpu(nbytes);
  }
  return {data, data, &CachingHostAllocator::release, c10::Device(c10::kCPU)};
}

MESHTORCH_DECL void* CachingHostAllocator::take_cached(std::size_t nbytes) {
  std::lock_guard lock(mutex_);
  ++stats_.large_allocations;
  const auto it = free_.lower_bound(nbytes);
  if (it == free_.end() || it->first / max_oversize > nbytes) return nullptr;
  const std::size_t size = it->first;
  void* data = it->second.back();
  in_tensor_locked(data, size);  // first: if it throws, nothing has changed
  it->second.pop_back();
  if (it->second.empty()) free_.erase(it);
  std::erase_if(order_, [&](const auto& entry) { return entry.second == data; });
  cached_bytes_ -= size;
  ++stats_.served_from_cache;
  return data;
}

MESHTORCH_DECL void* CachingHostAllocator::make_block(std::size_t nbytes) {
  const auto unmap_all = [](const Blocks& blocks) {
    for (const auto [size, block] : blocks) host_allocator_detail::unmap_block(block, size);
  };
  Blocks evicted;
  {
    std::lock_guard lock(mutex_);
    evicted = evict_locked(nbytes);
    pending_bytes_ += nbytes;
  }
  unmap_all(evicted);  // outside the lock: unmapping may take the kernel's time
  const auto not_made = [&] {
    std::lock_guard lock(mutex_);
    pending_bytes_ -= nbytes;
  };
  void* data = nullptr;
  try {
    data = host_allocator_detail::map_block(nbytes);
  } catch (const c10::OutOfMemoryError&) {
    // As CUDA's caching allocator does when the device is full: give back every cached block and
    // try once more.
    Blocks cached;
    {
      std::lock_guard lock(mutex_);
      cached = take_all_cached_locked();
    }
    unmap_all(cached);
    try {
      data = host_allocator_detail::map_block(nbytes);
    } catch (...) {
      not_made();
      throw;
    }
  }
  try {
    std::lock_guard lock(mutex_);
    in_tensor_locked(data, nbytes);
    pending_bytes_ -= nbytes;
  } catch (...) {
    host_allocator_detail::unmap_block(data, nbytes);
    not_made();
    throw;
  }
  return data;
}

MESHTORCH_DECL void CachingHostAllocator::in_tensor_locked(void* data, std::size_t nbytes) {
  live_.emplace(data, nbytes);
  live_bytes_ += nbytes;
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
}

MESHTORCH_DECL CachingHostAllocator::Blocks CachingHostAllocator::take_all_cached_locked() {
  Blocks blocks;
  blocks.reserve(order_.size());
  for (const auto& [size, data] : order_) blocks.emplace_back(size, data);
  free_.clear();
  order_.clear();
  cached_bytes_ = 0;
  return blocks;
}

MESHTORCH_DECL void CachingHostAllocator::release_cached() {
  Blocks blocks;
  {
    std::lock_guard lock(mutex_);
    blocks = take_all_cached_locked();
    peak_live_bytes_ = live_bytes_;
  }
  for (const auto [size, data] : blocks) host_allocator_detail::unmap_block(data, size);
}

MESHTORCH_DECL CachingHostAllocator::Blocks CachingHostAllocator::evict_locked(std::size_t wanted) {
  Blocks evicted;
  evicted.reserve(order_.size());  // first: if it throws, nothing has changed
  const std::size_t in_use = live_bytes_ + pending_bytes_ + wanted;
  const std::size_t budget = std::max(bound_locked(), in_use);
  while (in_use + cached_bytes_ > budget && !order_.empty()) {
    const auto [size, data] = order_.front();
    order_.pop_front();
    const auto list = free_.find(size);
    std::erase(list->second, data);
    if (list->second.empty()) free_.erase(list);
    evicted.emplace_back(size, data);
    cached_bytes_ -= size;
  }
  return evicted;
}

MESHTORCH_DECL void CachingHostAllocator::release(void* data) {
  if (!data) return;
  auto& self = instance();
  std::size_t large_bytes = 0;  // stays 0 for a small block, which is malloc's
  {
    std::lock_guard lock(self.mutex_);
    const auto it = self.live_.find(data);
    if (it != self.live_.end()) {
      large_bytes = it->second;
      self.live_.erase(it);
      self.live_bytes_ -= large_bytes;
      // Cached only within the cap and the bound: a block being made on another thread may have
      // counted on this one's bytes being in use, not cached.
      const bool within_bound =
          self.live_bytes_ + self.pending_bytes_ + self.cached_bytes_ + large_bytes <= self.bound_locked();
      if (within_bound && self.cached_bytes_ + large_bytes <= max_cached_bytes) {
        try {  // a deleter must not throw: a block that cannot be listed is given back instead
          auto& list = self.free_[large_bytes];
          list.push_back(data);
          try {
            self.order_.emplace_back(large_bytes, data);
          } catch (...) {
            list.pop_back();
            throw;
          }
          self.cached_bytes_ += large_bytes;
          return;
        } catch (...) {
        }
      }
    }
  }
  if (large_bytes > 0)
    host_allocator_detail::unmap_block(data, large_bytes);
  else
    c10::free_cpu(data);
}

MESHTORCH_DECL std::string use_host_allocator_from_environment() {
  const char* choice = std::getenv("MESHTORCH_HOST_ALLOCATOR");
  const std::string value = choice ? choice : "caching";
  if (value == "default") return value;
  if (value != "caching")
    throw ConfigError(
        fmt::format("MESHTORCH_HOST_ALLOCATOR is '{}': expected 'caching' (the default) or 'default' "
                    "(LibTorch's own CPU allocator)",
                    value));
  CachingHostAllocator::install();
  return value;
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
