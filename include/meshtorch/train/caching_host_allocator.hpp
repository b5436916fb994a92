#pragma once
// LibTorch's CPU allocator with a cache for large blocks, as CUDA's caching allocator keeps device
// blocks: a freed block of at least 1 MiB is kept by its exact size and handed out again for that
// size; a size it cannot serve first gives back as many bytes of the blocks cached longest. A training step allocates
// the same sizes at every step (a layer's gathered weights, the reduce-scatter buffers, gradients, activations), so
// after the first step they come from the cache. Without it glibc serves such blocks from its heap once its dynamic
// mmap threshold has grown past them, and the heap fragments: measured at llama-100m, chapter 7
// on 4 ranks (FSDP 2 x TP 2) held 0.91-1.05 GB per rank after 2 steps and 1.16 GB after 6, where
// its live tensors never exceed about 0.75 GB. glibc's own remedy (a fixed
// MALLOC_MMAP_THRESHOLD_) gives the memory back but zeroes every page again at every step
// (1.1-1.2x the step time). Small blocks go straight to c10's allocation functions, as LibTorch's
// default allocator does.
//
// launch() and chapter 1 install it on CPU runs; MESHTORCH_HOST_ALLOCATOR=default keeps LibTorch's own.
#include <cstddef>
#include <deque>
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
    return reserved_bytes_;
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

  // Gives every cached block back to the system.
  MESHTORCH_DECL void release_cached();

 private:
  CachingHostAllocator() = default;

  // A size the cache cannot serve is a phase whose blocks differ from the last one's (backward's
  // gradients after forward's activations): the blocks cached longest are given back, at least
  // as many bytes as are now asked for, so that the cache holds what recurs and not the previous
  // phase's sizes on top of this one's (which would raise the peak the cache is meant to lower).
  MESHTORCH_DECL std::vector<void*> evict_locked(std::size_t wanted);

  MESHTORCH_DECL static void release(void* data);

  mutable std::mutex mutex_;
  std::unordered_map<void*, std::size_t> live_;               // large blocks in tensors, by address
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // cached blocks, by size
  std::deque<std::pair<std::size_t, void*>> order_;           // cached blocks, oldest first
  std::size_t cached_bytes_ = 0;
  std::size_t reserved_bytes_ = 0;
  Stats stats_;
};

// launch()'s choice for CPU runs: the caching allocator unless MESHTORCH_HOST_ALLOCATOR says
// `default` (LibTorch's own, e.g. to measure with jemalloc preloaded). Returns which is in use.
MESHTORCH_DECL std::string use_host_allocator_from_environment();

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <cstdlib>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::train {

MESHTORCH_DECL CachingHostAllocator& CachingHostAllocator::instance() {
  static auto* allocator = new CachingHostAllocator();
  return *allocator;
}

MESHTORCH_DECL void CachingHostAllocator::install() { c10::SetCPUAllocator(&instance(), /*priority=*/1); }

MESHTORCH_DECL c10::DataPtr CachingHostAllocator::allocate(std::size_t nbytes) {
  void* data = nullptr;
  if (nbytes >= min_cached_bytes) {
    std::vector<void*> evicted;
    {
      std::lock_guard lock(mutex_);
      ++stats_.large_allocations;
      if (auto it = free_.find(nbytes); it != free_.end() && !it->second.empty()) {
        data = it->second.back();
        it->second.pop_back();
        std::erase_if(order_, [&](const auto& entry) { return entry.second == data; });
        cached_bytes_ -= nbytes;
        ++stats_.served_from_cache;
      } else {
        evicted = evict_locked(nbytes);
      }
    }
    // The system's part outside the lock: freeing and allocating may take the kernel's time.
    for (void* block : evicted) c10::free_cpu(block);
    const bool made = data == nullptr;
    if (made) data = c10::alloc_cpu(nbytes);
    std::lock_guard lock(mutex_);
    if (made) reserved_bytes_ += nbytes;
    live_[data] = nbytes;
  } else if (nbytes > 0) {
    data = c10::alloc_cpu(nbytes);
  }
  return {data, data, &CachingHostAllocator::release, c10::Device(c10::kCPU)};
}

MESHTORCH_DECL void CachingHostAllocator::release_cached() {
  std::unordered_map<std::size_t, std::vector<void*>> blocks;
  {
    std::lock_guard lock(mutex_);
    blocks.swap(free_);
    order_.clear();
    reserved_bytes_ -= cached_bytes_;
    cached_bytes_ = 0;
  }
  for (auto& [size, list] : blocks)
    for (void* data : list) c10::free_cpu(data);
}

MESHTORCH_DECL std::vector<void*> CachingHostAllocator::evict_locked(std::size_t wanted) {
  std::vector<void*> evicted;
  std::size_t freed = 0;
  while (freed < wanted && !order_.empty()) {
    const auto [size, data] = order_.front();
    order_.pop_front();
    auto& list = free_[size];
    std::erase(list, data);
    evicted.push_back(data);
    freed += size;
    cached_bytes_ -= size;
    reserved_bytes_ -= size;
  }
  return evicted;
}

MESHTORCH_DECL void CachingHostAllocator::release(void* data) {
  if (!data) return;
  auto& self = instance();
  {
    std::lock_guard lock(self.mutex_);
    const auto it = self.live_.find(data);
    if (it != self.live_.end()) {
      const auto nbytes = it->second;
      self.live_.erase(it);
      if (self.cached_bytes_ + nbytes <= max_cached_bytes) {
        self.free_[nbytes].push_back(data);
        self.order_.emplace_back(nbytes, data);
        self.cached_bytes_ += nbytes;
        return;
      }
      self.reserved_bytes_ -= nbytes;
    }
  }
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
